//! The transformer: loading its weights from a GGUF file and the forward pass, written
//! once against [`Backend`], [`WeightStore`], [`KvCache`], [`KvPolicy`] and
//! [`FeedForward`].

mod config;

use std::sync::Arc;

pub use config::{Architecture, ModelConfig};

use crate::backend::{AttentionShape, Backend, DeviceForwardInput, MatmulJob};
use crate::error::{Error, Result};
use crate::ffn::{DenseFfn, FeedForward};
use crate::ggml_type::GgmlType;
use crate::gguf::GgufFile;
use crate::kv::{KvCache, KvPolicy, KvShape};
use crate::quant;
use crate::store::{PassCounter, ResidentStore, WeightStore};
use crate::weights::{ByteSource, GlobalWeights, LayerWeights, Weight, WeightBytes};

impl ByteSource for GgufFile {
    fn bytes(&self) -> &[u8] {
        self.as_bytes()
    }
}

/// Which rows of logits a forward pass computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Only the last token's (generation).
    Last,
    /// Every token's (perplexity).
    All,
    /// None (prefill of a chunk that is not the last).
    None,
    /// The last token's greedy id only ([`Model::forward_greedy`]); a device backend
    /// then reads back one id instead of the logits. [`Model::forward`] treats it as
    /// [`Logits::Last`].
    Greedy,
}

/// Reads tensor `name` of `file` as a [`Weight`], checking its shape against `dims`.
fn weight(file: &Arc<GgufFile>, name: &str, dims: &[usize]) -> Result<Weight> {
    let info = file.tensor(name)?;
    let got: Vec<usize> = info.dims.iter().map(|&d| d as usize).collect();
    if got != dims {
        return Err(Error::TensorShape {
            tensor: name.to_string(),
            expected: dims.to_vec(),
            got,
        });
    }
    if matches!(info.ty, GgmlType::Q8_1 | GgmlType::Q8_K) {
        return Err(Error::UnsupportedWeightType {
            tensor: name.to_string(),
            ty: info.ty.name().to_string(),
        });
    }
    let start = info.offset as usize;
    let source: Arc<dyn ByteSource> = file.clone();
    Ok(Weight {
        name: name.to_string(),
        ty: info.ty,
        dims: got,
        bytes: WeightBytes::new(source, start..start + info.n_bytes as usize)?,
    })
}

/// Reads a one-dimensional tensor of length `len` as f32 values.
fn vector(file: &Arc<GgufFile>, name: &str, len: usize) -> Result<Arc<[f32]>> {
    let w = weight(file, name, &[len])?;
    let mut out = vec![0.0; len];
    quant::dequantize(w.ty, w.bytes.as_slice(), &mut out)?;
    Ok(out.into())
}

fn optional_vector(file: &Arc<GgufFile>, name: &str, len: usize) -> Result<Option<Arc<[f32]>>> {
    if file.tensors().iter().any(|t| t.name == name) {
        vector(file, name, len).map(Some)
    } else {
        Ok(None)
    }
}

/// Reads the weights of every layer of `file` for `config`, checking each shape.
pub fn load_weights(
    file: &Arc<GgufFile>,
    config: &ModelConfig,
) -> Result<(GlobalWeights, Vec<LayerWeights>)> {
    let (d, q, kv, ff) = (config.d_model, config.q_dim(), config.kv_dim(), config.n_ff);
    let token_embd = weight(file, "token_embd.weight", &[d, config.vocab_size])?;
    let output = if file.tensors().iter().any(|t| t.name == "output.weight") {
        weight(file, "output.weight", &[d, config.vocab_size])?
    } else {
        token_embd.clone()
    };
    let globals = GlobalWeights {
        output_norm: vector(file, "output_norm.weight", d)?,
        token_embd,
        output,
    };
    let mut layers = Vec::with_capacity(config.n_layers);
    for i in 0..config.n_layers {
        let n = |s: &str| format!("blk.{i}.{s}");
        layers.push(LayerWeights {
            index: i,
            attn_norm: vector(file, &n("attn_norm.weight"), d)?,
            wq: weight(file, &n("attn_q.weight"), &[d, q])?,
            wk: weight(file, &n("attn_k.weight"), &[d, kv])?,
            wv: weight(file, &n("attn_v.weight"), &[d, kv])?,
            bq: optional_vector(file, &n("attn_q.bias"), q)?,
            bk: optional_vector(file, &n("attn_k.bias"), kv)?,
            bv: optional_vector(file, &n("attn_v.bias"), kv)?,
            wo: weight(file, &n("attn_output.weight"), &[q, d])?,
            ffn_norm: vector(file, &n("ffn_norm.weight"), d)?,
            w_gate: weight(file, &n("ffn_gate.weight"), &[d, ff])?,
            w_up: weight(file, &n("ffn_up.weight"), &[d, ff])?,
            w_down: weight(file, &n("ffn_down.weight"), &[ff, d])?,
        });
    }
    Ok((globals, layers))
}

/// Activation buffers of one forward pass, kept between passes so decode allocates
/// nothing.
#[derive(Default)]
struct Scratch {
    x: Vec<f32>,
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    o: Vec<f32>,
    logits: Vec<f32>,
}

/// A loaded model: its configuration, where its weights come from, the backend that
/// computes, and the MLP implementation.
pub struct Model {
    config: ModelConfig,
    store: Box<dyn WeightStore>,
    backend: Arc<dyn Backend>,
    ffn: Box<dyn FeedForward>,
    passes: PassCounter,
    scratch: Scratch,
}

impl Model {
    /// Loads `file` with every weight resident ([`ResidentStore`]) and the exact MLP.
    pub fn load(file: Arc<GgufFile>, backend: Arc<dyn Backend>, mapped: bool) -> Result<Model> {
        let config = ModelConfig::from_gguf(&file)?;
        let (globals, layers) = load_weights(&file, &config)?;
        let store = Box::new(ResidentStore::new(globals, layers, mapped));
        Ok(Model::from_parts(
            config,
            store,
            backend,
            Box::new(DenseFfn::new()),
        ))
    }

    /// A model from its parts: any store, backend and MLP.
    pub fn from_parts(
        config: ModelConfig,
        store: Box<dyn WeightStore>,
        backend: Arc<dyn Backend>,
        ffn: Box<dyn FeedForward>,
    ) -> Model {
        Model {
            config,
            store,
            backend,
            ffn,
            passes: PassCounter::default(),
            scratch: Scratch::default(),
        }
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The backend computing this model.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// Where the weights come from.
    pub fn store(&self) -> &dyn WeightStore {
        self.store.as_ref()
    }

    /// The shape of the KV cache this model needs.
    pub fn kv_shape(&self) -> KvShape {
        KvShape {
            n_layers: self.config.n_layers,
            n_kv_heads: self.config.n_kv_heads,
            head_dim: self.config.head_dim,
        }
    }

    /// Runs the tokens `ids` at `positions` through the model, appending their keys and
    /// values to `kv`, and returns the requested logits (`vocab_size` per row).
    pub fn forward(
        &mut self,
        ids: &[u32],
        positions: &[u32],
        kv: &mut dyn KvCache,
        mut policy: Option<&mut dyn KvPolicy>,
        logits: Logits,
    ) -> Result<&[f32]> {
        let logits = if logits == Logits::Greedy {
            Logits::Last
        } else {
            logits
        };
        // A bounded cache makes room before anything is appended.
        if let Some(p) = policy.as_deref_mut() {
            p.before_pass(kv, ids.len())?;
        }
        self.check_input(ids, positions, kv)?;
        if self.whole_pass_on_device(policy.as_deref()) {
            self.device_pass(ids, positions, kv, logits)?;
        } else {
            self.host_pass(ids, positions, kv, policy, logits)?;
        }
        Ok(match logits {
            Logits::None => &[],
            _ => &self.scratch.logits,
        })
    }

    /// Like [`Model::forward`] with [`Logits::Last`], but returns only the greedy id
    /// (largest logit, lowest id on ties). A device backend computes it on the device and
    /// reads back that one id.
    pub fn forward_greedy(
        &mut self,
        ids: &[u32],
        positions: &[u32],
        kv: &mut dyn KvCache,
        mut policy: Option<&mut dyn KvPolicy>,
    ) -> Result<u32> {
        if let Some(p) = policy.as_deref_mut() {
            p.before_pass(kv, ids.len())?;
        }
        self.check_input(ids, positions, kv)?;
        if self.whole_pass_on_device(policy.as_deref()) {
            return self
                .device_pass(ids, positions, kv, Logits::Greedy)?
                .ok_or_else(|| Error::Gpu {
                    what: "the device pass returned no greedy id".into(),
                });
        }
        self.host_pass(ids, positions, kv, policy, Logits::Last)?;
        Ok(crate::sampler::argmax(&self.scratch.logits))
    }

    /// Whether the pass can run on the backend's device at once: the backend has a
    /// device, the MLP is the exact one, and no policy changes the cache between layers.
    fn whole_pass_on_device(&self, policy: Option<&dyn KvPolicy>) -> bool {
        self.backend.device_forward().is_some()
            && self.ffn.is_exact()
            && policy.is_none_or(|p| !p.acts_between_layers())
    }

    /// The whole pass on the backend's device: the same sequence of ops as
    /// [`Model::host_pass`], recorded there as one submission.
    fn device_pass(
        &mut self,
        ids: &[u32],
        positions: &[u32],
        kv: &mut dyn KvCache,
        logits: Logits,
    ) -> Result<Option<u32>> {
        let device = self
            .backend
            .device_forward()
            .expect("checked by the caller");
        let pass = self.passes.next();
        let store = &self.store;
        let input = DeviceForwardInput {
            config: &self.config,
            globals: store.globals(),
            ids,
            positions,
            logits,
        };
        device.forward(
            &input,
            &mut |l| store.layer(pass, l),
            kv,
            &mut self.scratch.logits,
        )
    }

    fn check_input(&self, ids: &[u32], positions: &[u32], kv: &dyn KvCache) -> Result<()> {
        let n = ids.len();
        if n == 0 || positions.len() != n {
            return Err(Error::ShapeMismatch {
                what: "token positions".into(),
                expected: n,
                got: positions.len(),
            });
        }
        if kv.shape() != self.kv_shape() {
            return Err(Error::KvFormat {
                why: "the cache's shape is not this model's".into(),
            });
        }
        if kv.len() + n > kv.capacity() {
            return Err(Error::ContextFull {
                needed: kv.len() + n,
                capacity: kv.capacity(),
            });
        }
        Ok(())
    }

    /// The pass op by op through [`Backend`] on host activations.
    fn host_pass(
        &mut self,
        ids: &[u32],
        positions: &[u32],
        kv: &mut dyn KvCache,
        mut policy: Option<&mut dyn KvPolicy>,
        logits: Logits,
    ) -> Result<()> {
        let n = ids.len();
        let c = &self.config;
        let be = &self.backend;
        let pass = self.passes.next();
        let s = &mut self.scratch;
        s.x.resize(n * c.d_model, 0.0);
        s.h.resize(n * c.d_model, 0.0);
        s.q.resize(n * c.q_dim(), 0.0);
        s.k.resize(n * c.kv_dim(), 0.0);
        s.v.resize(n * c.kv_dim(), 0.0);
        s.attn.resize(n * c.q_dim(), 0.0);
        s.o.resize(n * c.d_model, 0.0);
        let globals = self.store.globals();
        be.embed(&globals.token_embd, ids, &mut s.x)?;
        let shape = AttentionShape {
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
        };
        for l in 0..c.n_layers {
            let w = self.store.layer(pass, l)?;
            be.rms_norm(&s.x, &w.attn_norm, c.rms_eps, &mut s.h)?;
            self.ffn.prepare(l, &s.h, n)?;
            be.matmul(
                &s.h,
                n,
                &mut [
                    MatmulJob {
                        weight: &w.wq,
                        out: &mut s.q,
                    },
                    MatmulJob {
                        weight: &w.wk,
                        out: &mut s.k,
                    },
                    MatmulJob {
                        weight: &w.wv,
                        out: &mut s.v,
                    },
                ],
            )?;
            for (bias, out) in [(&w.bq, &mut s.q), (&w.bk, &mut s.k), (&w.bv, &mut s.v)] {
                if let Some(b) = bias {
                    be.add_bias(out, b)?;
                }
            }
            be.rope(&mut s.q, positions, c.n_heads, c.head_dim, &c.rope)?;
            be.rope(&mut s.k, positions, c.n_kv_heads, c.head_dim, &c.rope)?;
            kv.append(l, positions, &s.k, &s.v)?;
            if let Some(p) = policy.as_deref_mut() {
                p.before_attention(l, kv)?;
            }
            be.attention(&s.q, positions, &kv.view(l), &shape, &mut s.attn)?;
            be.matmul(
                &s.attn,
                n,
                &mut [MatmulJob {
                    weight: &w.wo,
                    out: &mut s.o,
                }],
            )?;
            be.add_assign(&mut s.x, &s.o)?;
            be.rms_norm(&s.x, &w.ffn_norm, c.rms_eps, &mut s.h)?;
            self.ffn.forward(be.as_ref(), &w, &s.h, n, &mut s.o)?;
            be.add_assign(&mut s.x, &s.o)?;
        }
        let (rows, first) = match logits {
            Logits::None => return Ok(()),
            Logits::Last | Logits::Greedy => (1, n - 1),
            Logits::All => (n, 0),
        };
        let d = c.d_model;
        be.rms_norm(
            &s.x[first * d..],
            &globals.output_norm,
            c.rms_eps,
            &mut s.h[..rows * d],
        )?;
        s.logits.resize(rows * c.vocab_size, 0.0);
        be.matmul(
            &s.h[..rows * d],
            rows,
            &mut [MatmulJob {
                weight: &globals.output,
                out: &mut s.logits,
            }],
        )
    }
}
