//! Session files: the cached keys and values of every layer with their positions, the
//! token ids, and the logits after the last token, so that a conversation resumes
//! without recomputing its prompt.
//!
//! Layout (little-endian): magic `BLSTSESS`, version `u32`, model fingerprint `u64`,
//! precision `u8`, update mode `u8`, two zero bytes, layers / KV heads / head size
//! `u32` each, capacity `u64`, token count `u64` and the ids (`u32`), logit count `u64`
//! and the logits (`f32`), payload length `u64` and the cache's own payload
//! ([`KvCache::save`]: per layer the positions and stored rows in cache order, so a
//! file saved from one update mode loads into another), policy state length `u64` and
//! the policy's state (`KvPolicy::state`: StreamingLLM's sinks as first seen; version 2
//! on, absent in version 1 files, which still load), then a 64-bit checksum of
//! everything before it. Written to a temporary file in the same folder, synced, then
//! renamed over the target: a crash leaves the old file or the new one, never half.

use std::io::Write;
use std::path::{Path, PathBuf};

use ballast_core::KvCache;

use crate::error::{Error, Result};
use crate::modes::UpdateMode;
use ballast_core::KvElement;

const MAGIC: &[u8; 8] = b"BLSTSESS";
/// The session file version this build writes (it reads this one and version 1).
pub const SESSION_VERSION: u32 = 2;

/// What a session file must agree with to load: the model and the cache's precision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SessionMeta {
    /// [`model_fingerprint`] of the model.
    pub fingerprint: u64,
    /// KvElement of the cache.
    pub precision: KvElement,
    /// Update mode of the cache (recorded; a file loads into any mode).
    pub mode: UpdateMode,
}

/// What a session file held besides the cache.
#[derive(Clone, Debug, PartialEq)]
pub struct SavedSession {
    /// Every token id fed.
    pub tokens: Vec<u32>,
    /// Logits after the last token.
    pub logits: Vec<f32>,
    /// The update mode the cache was saved from.
    pub mode: UpdateMode,
    /// The KV policy's state (`KvPolicy::state`), empty if it had none; give it to
    /// the policy with `KvPolicy::restore_state`.
    pub policy_state: Vec<u8>,
}

pub use ballast_core::fingerprint::{checksum, model_fingerprint};

/// Writes `cache`, `tokens`, `logits` and the KV policy's `policy_state`
/// (`KvPolicy::state`, empty without a policy) to `path` atomically (temporary file,
/// sync, rename).
pub fn save_session(
    path: &Path,
    meta: SessionMeta,
    cache: &dyn KvCache,
    tokens: &[u32],
    logits: &[f32],
    policy_state: &[u8],
) -> Result<()> {
    let io = |source| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    let shape = cache.shape();
    let mut buf = Vec::new();
    buf.extend_from_slice(MAGIC);
    buf.extend_from_slice(&SESSION_VERSION.to_le_bytes());
    buf.extend_from_slice(&meta.fingerprint.to_le_bytes());
    buf.extend_from_slice(&[meta.precision.tag(), meta.mode.tag(), 0, 0]);
    for v in [shape.n_layers, shape.n_kv_heads, shape.head_dim] {
        buf.extend_from_slice(&(v as u32).to_le_bytes());
    }
    buf.extend_from_slice(&(cache.capacity() as u64).to_le_bytes());
    buf.extend_from_slice(&(tokens.len() as u64).to_le_bytes());
    buf.extend_from_slice(bytemuck::cast_slice(tokens));
    buf.extend_from_slice(&(logits.len() as u64).to_le_bytes());
    buf.extend_from_slice(bytemuck::cast_slice(logits));
    let mut payload = Vec::new();
    cache.save(&mut payload)?;
    buf.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    buf.extend_from_slice(&payload);
    buf.extend_from_slice(&(policy_state.len() as u64).to_le_bytes());
    buf.extend_from_slice(policy_state);
    let sum = checksum(&buf);
    buf.extend_from_slice(&sum.to_le_bytes());

    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map_or("session".into(), |n| n.to_string_lossy().into_owned());
    let tmp: PathBuf = dir.join(format!(".{name}.tmp.{}", std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&buf)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io(e)
    })
}

/// Reads `path` into `cache` and returns the tokens and logits it held. Every check
/// (magic, version, checksum, model, precision, shape, capacity) runs before the
/// cache is touched; on any error the cache is as it was.
pub fn load_session(
    path: &Path,
    meta: SessionMeta,
    cache: &mut dyn KvCache,
) -> Result<SavedSession> {
    let p = || path.to_path_buf();
    let bytes = std::fs::read(path).map_err(|source| Error::Io { path: p(), source })?;
    let mut rest: &[u8] = &bytes;
    let mut take = |n: u64, what: &'static str| -> Result<&[u8]> {
        if (rest.len() as u64) < n {
            return Err(Error::Truncated {
                path: p(),
                what,
                needed: n,
                left: rest.len() as u64,
            });
        }
        let (head, tail) = rest.split_at(n as usize);
        rest = tail;
        Ok(head)
    };
    let u64_at = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
    let u32_at = |b: &[u8]| u32::from_le_bytes(b.try_into().expect("4 bytes"));
    if take(8, "magic")? != MAGIC {
        return Err(Error::BadMagic { path: p() });
    }
    let version = u32_at(take(4, "version")?);
    if !(1..=SESSION_VERSION).contains(&version) {
        return Err(Error::Version {
            path: p(),
            found: version,
            supported: SESSION_VERSION,
        });
    }
    let fingerprint = u64_at(take(8, "model fingerprint")?);
    let tags = take(4, "precision and mode")?.to_vec();
    let dims: Vec<u32> = (0..3)
        .map(|_| take(4, "shape").map(u32_at))
        .collect::<Result<_>>()?;
    let capacity = u64_at(take(8, "capacity")?);
    let n_tokens = u64_at(take(8, "token count")?);
    let tokens: Vec<u32> =
        bytemuck::pod_collect_to_vec(take(n_tokens.saturating_mul(4), "token ids")?);
    let n_logits = u64_at(take(8, "logit count")?);
    let logits: Vec<f32> =
        bytemuck::pod_collect_to_vec(take(n_logits.saturating_mul(4), "logits")?);
    let payload_len = u64_at(take(8, "payload length")?);
    let payload = take(payload_len, "KV payload")?;
    let policy_state = if version >= 2 {
        let n = u64_at(take(8, "policy state length")?);
        take(n, "policy state")?.to_vec()
    } else {
        Vec::new()
    };
    let found_sum = u64_at(take(8, "checksum")?);
    if !rest.is_empty() {
        return Err(Error::Invalid {
            path: p(),
            why: format!("{} bytes after the checksum", rest.len()),
        });
    }
    let computed = checksum(&bytes[..bytes.len() - 8]);
    if computed != found_sum {
        return Err(Error::Checksum {
            path: p(),
            found: found_sum,
            computed,
        });
    }
    if fingerprint != meta.fingerprint {
        return Err(Error::WrongModel {
            path: p(),
            found: fingerprint,
            expected: meta.fingerprint,
        });
    }
    let precision = KvElement::from_tag(tags[0]).ok_or_else(|| Error::Invalid {
        path: p(),
        why: format!("unknown precision tag {}", tags[0]),
    })?;
    let mode = UpdateMode::from_tag(tags[1]).ok_or_else(|| Error::Invalid {
        path: p(),
        why: format!("unknown update mode tag {}", tags[1]),
    })?;
    if precision != meta.precision {
        return Err(Error::DtypeMismatch {
            path: p(),
            found: precision.name().into(),
            expected: meta.precision.name().into(),
        });
    }
    let shape = cache.shape();
    let want = [shape.n_layers, shape.n_kv_heads, shape.head_dim].map(|v| v as u32);
    if dims != want {
        return Err(Error::Invalid {
            path: p(),
            why: format!("cache shape {dims:?} is not this model's {want:?}"),
        });
    }
    if capacity > cache.capacity() as u64 {
        // Loading still checks each layer against the capacity; this names the cause.
        let held = u64_at(payload.get(8 + 1 + 24..8 + 1 + 32).unwrap_or(&[0; 8]));
        if held > cache.capacity() as u64 {
            return Err(Error::Invalid {
                path: p(),
                why: format!(
                    "the session holds {held} tokens, more than this cache's capacity of {} (raise -c)",
                    cache.capacity()
                ),
            });
        }
    }
    cache.load(&mut &payload[..])?;
    Ok(SavedSession {
        tokens,
        logits,
        mode,
        policy_state,
    })
}
