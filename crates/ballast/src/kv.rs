//! The KV cache a session gets (`ballast-kv-cache`): update mode, element type,
//! eviction policy.

use std::str::FromStr;

use ballast_kv_cache::{new_cache, KvElement, PolicyKind, StreamingLlm, UpdateMode};
use ballast_runtime::{KvCache, KvPolicy, Model};

use crate::error::{Error, Result};

/// What a cache evicts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum Eviction {
    /// Nothing: the cache grows to the context, then a pass fails.
    #[default]
    None,
    /// The most recent [`KvOptions::window`] tokens.
    Window,
    /// StreamingLLM: the first [`KvOptions::sink`] tokens plus the most recent
    /// [`KvOptions::window`].
    Streaming,
}

impl Eviction {
    /// `none`, `window` or `streaming`.
    pub fn name(self) -> &'static str {
        match self {
            Eviction::None => "none",
            Eviction::Window => "window",
            Eviction::Streaming => "streaming",
        }
    }
}

impl FromStr for Eviction {
    type Err = Error;

    fn from_str(s: &str) -> Result<Eviction> {
        match s {
            "none" => Ok(Eviction::None),
            "window" => Ok(Eviction::Window),
            "streaming" => Ok(Eviction::Streaming),
            _ => Err(Error::Invalid(format!(
                "unknown KV policy `{s}`: none, window or streaming"
            ))),
        }
    }
}

/// A KV cache and the policy that may evict from it.
pub type CacheAndPolicy = (Box<dyn KvCache>, Option<Box<dyn KvPolicy>>);

/// The KV cache of a session: how it updates, what it stores, what it evicts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvOptions {
    /// How a host cache updates on eviction (ring, shift, mask). Default: ring.
    pub mode: UpdateMode,
    /// Element type of cached keys and values (approximate below f32). `None`: the
    /// model's default for its backend (f16 on the CPU, f32 on a GPU).
    pub dtype: Option<KvElement>,
    /// What to evict. Default: nothing.
    pub policy: Eviction,
    /// Attention sinks kept by [`Eviction::Streaming`]. Default 4.
    pub sink: usize,
    /// Recent tokens kept by [`Eviction::Window`] and [`Eviction::Streaming`].
    /// `None`: the context (minus the sinks).
    pub window: Option<usize>,
}

impl Default for KvOptions {
    fn default() -> KvOptions {
        KvOptions {
            mode: UpdateMode::PointerShift,
            dtype: None,
            policy: Eviction::None,
            sink: 4,
            window: None,
        }
    }
}

impl KvOptions {
    /// The element type asked for, else the model's default for its backend.
    pub fn element(&self, model: &Model) -> KvElement {
        self.dtype.unwrap_or_else(|| model.default_kv_element())
    }

    /// The policy these options describe, for a context of `ctx` tokens.
    pub fn kind(&self, ctx: usize) -> PolicyKind {
        match self.policy {
            Eviction::Window => PolicyKind::Window {
                window: self.window.unwrap_or(ctx),
            },
            Eviction::Streaming => PolicyKind::Streaming {
                n_sink: self.sink,
                window: self.window.unwrap_or(ctx.saturating_sub(self.sink)),
            },
            Eviction::None => PolicyKind::None,
        }
    }

    /// An empty cache of `capacity` tokens for `model`, fed passes of at most `chunk`
    /// tokens: on its device where the backend keeps KV rows there (the update mode
    /// then does not apply: the device masks evicted slots and moves nothing), else in
    /// host memory in the update mode asked for; either way its sliding-window layers
    /// (gemma3's local ones) keep only their window when no policy evicts.
    pub fn cache(&self, model: &Model, capacity: usize, chunk: usize) -> Result<Box<dyn KvCache>> {
        let element = self.element(model);
        // A policy evicts by cache index across every layer: its caches keep every
        // token of a windowed layer (masked past the window).
        let windowed = self.policy == Eviction::None;
        let device = if windowed {
            model.device_kv_cache_windowed(capacity, element, chunk)?
        } else {
            model.device_kv_cache(capacity, element)?
        };
        if let Some(cache) = device {
            return Ok(cache);
        }
        let mode = self.mode;
        let make = |shape, capacity| new_cache(mode, shape, capacity, element);
        Ok(if windowed {
            model.host_kv_cache(capacity, chunk, make)?
        } else {
            make(model.kv_shape(), capacity)?
        })
    }

    /// A cache and a policy for `model`: with a policy the cache holds exactly its
    /// budget (sinks plus window), without one `ctx` tokens.
    pub fn build(&self, model: &Model, ctx: usize, chunk: usize) -> Result<CacheAndPolicy> {
        let kind = self.kind(ctx);
        let capacity = kind.budget().unwrap_or(ctx);
        let cache = self.cache(model, capacity, chunk)?;
        // Each layer's own RoPE: gemma3's sliding layers turn with another base.
        let layer_ropes = model.config().layer_ropes();
        let policy = StreamingLlm::from_kind(kind, model.backend().clone(), layer_ropes)?
            .map(|p| Box::new(p) as Box<dyn KvPolicy>);
        Ok((cache, policy))
    }
}
