//! The transformer: loading its weights from a GGUF file and the forward pass, written
//! once against [`Backend`], [`WeightStore`], [`KvCache`], [`KvPolicy`] and
//! [`FeedForward`].

pub mod blocks;
mod config;

use std::sync::Arc;

pub use crate::arch::TensorSpec;
pub use config::{ModelConfig, MoeSpec};

use crate::arch::Pass;
use crate::backend::{Backend, DeviceForwardInput};
use crate::error::{Error, Result};
use crate::ffn::FeedForward;
use crate::ggml_type::GgmlType;
use crate::gguf::GgufFile;
use crate::graph::{self, Graph, HostPass, Op, PassSequence};
use crate::kv::{KvCache, KvElement, KvPolicy, KvShape};
use crate::quant;
use crate::store::{PassCounter, ResidentStore, WeightStore};
use crate::weights::{ByteSource, GlobalWeights, LayerWeights, Weight, WeightBytes, WeightId};
use ballast_kv_cache::WindowedKv;
use blocks::HeadRows;

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
        id: WeightId {
            file: file.id(),
            offset: info.offset,
        },
        ty: info.ty,
        dims: got,
        bytes: WeightBytes::new(source, start..start + info.n_bytes as usize)?,
    })
}

/// Reads a one-dimensional tensor of length `len` as f32 values.
fn vector(file: &Arc<GgufFile>, name: &str, len: usize) -> Result<Arc<[f32]>> {
    let w = weight(file, name, &[len])?;
    let mut out = vec![0.0; len];
    quant::dequantize(w.ty, w.bytes.as_slice()?, &mut out)?;
    Ok(out.into())
}

/// The layer table `config`'s architecture reads for layer `layer`.
pub fn layer_tensors(config: &ModelConfig, layer: usize) -> Vec<TensorSpec> {
    config.arch.layer_tensors(config, layer)
}

/// Reads the weights of every layer of `file` for `config`, checking each shape: the
/// global tensors and, per layer, the table of named tensors its architecture lists.
pub fn load_weights(
    file: &Arc<GgufFile>,
    config: &ModelConfig,
) -> Result<(GlobalWeights, Vec<LayerWeights>)> {
    let (mut matrices, vectors) =
        read_table(file, config.arch.global_tensors(config), |r| r.to_string())?;
    // A model without an output head ties it to the embedding table.
    if !matrices.iter().any(|(r, _)| r == blocks::OUTPUT) {
        if let Some((_, embd)) = matrices.iter().find(|(r, _)| r == blocks::TOKEN_EMBD) {
            matrices.push((blocks::OUTPUT.to_string(), embd.clone()));
        }
    }
    let globals = GlobalWeights::new(matrices, vectors)?;
    let mut layers = Vec::with_capacity(config.n_layers);
    for index in 0..config.n_layers {
        let table = layer_tensors(config, index);
        let (matrices, vectors) = read_table(file, table, |r| format!("blk.{index}.{r}"))?;
        layers.push(LayerWeights::new(index, matrices, vectors));
    }
    Ok((globals, layers))
}

/// The configuration and weights of `file`, the head cut to its first `vocab` rows
/// (the configuration then saying `vocab` tokens) when the vocabulary is larger.
fn load_with_head(
    file: &Arc<GgufFile>,
    vocab: usize,
) -> Result<(ModelConfig, GlobalWeights, Vec<LayerWeights>)> {
    let mut config = ModelConfig::from_gguf(file)?;
    let (mut globals, layers) = load_weights(file, &config)?;
    if vocab < config.vocab_size {
        globals.truncate_output(vocab)?;
        config.vocab_size = vocab;
    }
    Ok((config, globals, layers))
}

/// Matrices and vectors by role.
type Table = (Vec<(String, Weight)>, Vec<(String, Arc<[f32]>)>);

/// Reads the tensors `table` lists from `file` (each named `name(role)`), checking each
/// shape; an optional one the file lacks is left out.
fn read_table(
    file: &Arc<GgufFile>,
    table: Vec<TensorSpec>,
    name: impl Fn(&str) -> String,
) -> Result<Table> {
    let (mut matrices, mut vectors) = (Vec::new(), Vec::new());
    for spec in table {
        let name = name(spec.role);
        if !spec.required && !file.tensors().iter().any(|t| t.name == name) {
            continue;
        }
        if let [len] = spec.dims[..] {
            vectors.push((spec.role.to_string(), vector(file, &name, len)?));
        } else {
            matrices.push((spec.role.to_string(), weight(file, &name, &spec.dims)?));
        }
    }
    Ok((matrices, vectors))
}

/// Activation buffers of one forward pass on the host, one per tensor of the pass,
/// kept between passes so decode allocates nothing.
#[derive(Default)]
struct Scratch {
    buffers: Vec<Vec<f32>>,
    /// The logits of the last pass, wherever they were computed.
    logits: Vec<f32>,
    /// The last pass's graph and what it was built for: decode builds one graph, not
    /// one per token.
    graph: Option<(GraphKey, Arc<Graph>)>,
    /// A batched pass's tokens and positions, every sequence's in turn.
    batch_ids: Vec<u32>,
    batch_positions: Vec<u32>,
}

/// What a pass's graph depends on besides the model.
#[derive(Clone, Debug, PartialEq, Eq)]
struct GraphKey {
    tokens: usize,
    /// The rows the head computes, if any.
    head: Option<HeadRows>,
    /// Only the argmax of the logits is wanted.
    greedy: bool,
    /// A KV policy acts between layers.
    policy_between_layers: bool,
}

/// One sequence of a batched pass ([`Model::forward_batch`]): its tokens at its
/// positions, the cache they append to and attend over, and its policy.
pub struct BatchSequence<'a> {
    /// Token ids.
    pub ids: &'a [u32],
    /// Their positions.
    pub positions: &'a [u32],
    /// Its cache.
    pub kv: &'a mut dyn KvCache,
    /// Its KV policy.
    pub policy: Option<&'a mut dyn KvPolicy>,
    /// Whether the logits after its last token are wanted.
    pub logits: bool,
    /// Whether the logits after every one of its tokens are wanted (a speculative
    /// verification); implies `logits`.
    pub every_row: bool,
}

/// What every handle on a loaded model shares, read-only: the configuration, the
/// store the weights come from, and the backend that computes. Held once, however many
/// sessions run on it.
struct Shared {
    config: ModelConfig,
    store: Box<dyn WeightStore>,
    backend: Arc<dyn Backend>,
    passes: PassCounter,
}

impl Drop for Shared {
    /// The last handle gone, a device backend gives back the memory of this model's
    /// weights (all read from the file of its embedding table).
    fn drop(&mut self) {
        if let Some(memory) = self.backend.residency() {
            let globals = self.store.globals();
            memory.release_file(globals.token_embd().id.file);
            if globals.output().id.file != globals.token_embd().id.file {
                memory.release_file(globals.output().id.file);
            }
        }
    }
}

/// A handle on a loaded model: the shared, read-only part (configuration, weights and
/// their store, backend) and what one conversation needs to run passes on it (host
/// activation buffers, the MLP lever with its state).
///
/// [`Model::share`] makes another handle on the same weights for another session: each
/// session owns its handle, KV cache and positions (a `Generator` adds the sampler),
/// and sessions may run from different threads (a handle is `Send`); the weights are
/// held once.
pub struct Model {
    shared: Arc<Shared>,
    ffn: Box<dyn FeedForward>,
    scratch: Scratch,
}

impl Model {
    /// Loads `file` with every weight resident ([`ResidentStore`]) and the exact MLP
    /// (dense, or the mixture of experts the file has).
    pub fn load(file: Arc<GgufFile>, backend: Arc<dyn Backend>, mapped: bool) -> Result<Model> {
        Model::load_with_vocab(file, backend, mapped, usize::MAX)
    }

    /// [`Model::load`] with a head that computes the logits of the first `vocab` tokens
    /// only (all of them when the vocabulary is no larger), the model's configuration
    /// then saying `vocab` tokens: a draft model's, which needs only its likeliest
    /// tokens. A BPE or SentencePiece vocabulary numbers its tokens roughly from the
    /// most frequent (merge order, or score), so the first tokens are the frequent ones
    /// (FR-Spec, Zhao et al. 2025). The head is most of a small model's bytes per
    /// token; a token past `vocab` is never drafted, so the model decodes it itself.
    pub fn load_with_vocab(
        file: Arc<GgufFile>,
        backend: Arc<dyn Backend>,
        mapped: bool,
        vocab: usize,
    ) -> Result<Model> {
        let (config, globals, layers) = load_with_head(&file, vocab)?;
        let store = Box::new(ResidentStore::new(globals, layers, mapped));
        let ffn = crate::ffn::for_config(&config);
        Ok(Model::from_parts(config, store, backend, ffn))
    }

    /// A draft model held beside another: `file` (memory-mapped) with the head cut to
    /// `vocab` tokens ([`Model::load_with_vocab`]), every matrix a token reads copied
    /// into RAM, and the embedding table left mapped (a token reads one row of it). The
    /// RAM it holds is what it reads per token, not the file: the Qwen2.5-Coder-0.5B
    /// draft holds 266 MiB of its 469.
    pub fn load_draft(
        file: Arc<GgufFile>,
        backend: Arc<dyn Backend>,
        vocab: usize,
    ) -> Result<Model> {
        let (config, mut globals, mut layers) = load_with_head(&file, vocab)?;
        let in_ram = |w: &mut Weight| -> Result<()> {
            w.bytes = WeightBytes::from_vec(w.bytes.as_slice()?.to_vec());
            Ok(())
        };
        in_ram(globals.output_mut())?;
        for layer in &mut layers {
            for w in layer.weights_mut() {
                in_ram(w)?;
            }
        }
        let store = Box::new(ResidentStore::new(globals, layers, false));
        let ffn = crate::ffn::for_config(&config);
        Ok(Model::from_parts(config, store, backend, ffn))
    }

    /// A model from its parts: any store, backend and MLP.
    pub fn from_parts(
        config: ModelConfig,
        store: Box<dyn WeightStore>,
        backend: Arc<dyn Backend>,
        ffn: Box<dyn FeedForward>,
    ) -> Model {
        Model {
            shared: Arc::new(Shared {
                config,
                store,
                backend,
                passes: PassCounter::default(),
            }),
            ffn,
            scratch: Scratch::default(),
        }
    }

    /// Another handle on the same weights, store and backend, with its own activation
    /// buffers and the exact MLP (dense, or the model's mixture of experts): what a
    /// second session runs on. Nothing is copied but a reference count.
    pub fn share(&self) -> Model {
        self.share_with_ffn(crate::ffn::for_config(self.config()))
    }

    /// Like [`Model::share`], with `ffn` as this handle's MLP.
    pub fn share_with_ffn(&self, ffn: Box<dyn FeedForward>) -> Model {
        Model {
            shared: self.shared.clone(),
            ffn,
            scratch: Scratch::default(),
        }
    }

    /// True if `self` and `other` are handles on the same loaded weights.
    pub fn shares_weights_with(&self, other: &Model) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared)
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.shared.config
    }

    /// The backend computing this model.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.shared.backend
    }

    /// Where the weights come from.
    pub fn store(&self) -> &dyn WeightStore {
        self.shared.store.as_ref()
    }

    /// A KV cache of `capacity` tokens in `element` whose rows live on this model's
    /// device, when its backend keeps them there (wgpu: the pass then reads back no
    /// keys or values); `None` on a backend without device passes, where the caller
    /// uses a host cache.
    pub fn device_kv_cache(
        &self,
        capacity: usize,
        element: KvElement,
    ) -> Result<Option<Box<dyn KvCache>>> {
        let backend = &self.shared.backend;
        match backend.executor() {
            Some(device) => device.new_kv_cache(self.kv_shape(), capacity, element),
            None => Ok(None),
        }
    }

    /// [`Model::device_kv_cache`] whose sliding-window layers keep only their window
    /// plus one pass of at most `chunk` tokens (as [`Model::host_kv_cache`] does on
    /// the host).
    pub fn device_kv_cache_windowed(
        &self,
        capacity: usize,
        element: KvElement,
        chunk: usize,
    ) -> Result<Option<Box<dyn KvCache>>> {
        let backend = &self.shared.backend;
        match backend.executor() {
            Some(device) => device.new_windowed_kv_cache(
                self.kv_shape(),
                capacity,
                element,
                &self.kv_windows(),
                chunk,
            ),
            None => Ok(None),
        }
    }

    /// The sliding window of each layer (`None`: the layer sees every token).
    pub fn kv_windows(&self) -> Vec<Option<usize>> {
        self.shared
            .config
            .layer_attention
            .iter()
            .map(|a| a.shape.window)
            .collect()
    }

    /// A host KV cache of `capacity` tokens made by `make`: when the model has
    /// sliding-window layers and their window is shorter than the context, a
    /// [`WindowedKv`] whose windowed layers keep only their window (plus one pass of
    /// at most `chunk` tokens), each part made by `make`; otherwise `make` of the whole
    /// shape.
    pub fn host_kv_cache(
        &self,
        capacity: usize,
        chunk: usize,
        mut make: impl FnMut(KvShape, usize) -> Result<Box<dyn KvCache>>,
    ) -> Result<Box<dyn KvCache>> {
        let windows = self.kv_windows();
        let widest = windows.iter().flatten().copied().max();
        match widest {
            Some(w) if w - 1 + chunk.max(1) < capacity => Ok(Box::new(WindowedKv::new(
                self.kv_shape(),
                capacity,
                &windows,
                chunk,
                make,
            )?)),
            _ => make(self.kv_shape(), capacity),
        }
    }

    /// The element type a KV cache gets when none is asked for: f16 (llama.cpp's
    /// default) where the CPU runs attention, f32 where a device pass does. The device
    /// sums attention in its own order, and over f16 rows that moved a greedy id of the
    /// golden prompts off llama.cpp's at a step where llama.cpp's margin is wide
    /// ("def fibonacci(n):", step 25: our margin 0.06 the other way); over f32 rows it
    /// matches every id up to the first near-tie, so the default keeps it. f16 and q8
    /// stay on the device as asked.
    pub fn default_kv_element(&self) -> KvElement {
        match self.shared.backend.executor() {
            Some(_) => KvElement::F32,
            None => KvElement::F16,
        }
    }

    /// The shape of the KV cache this model needs.
    pub fn kv_shape(&self) -> KvShape {
        KvShape {
            n_layers: self.shared.config.n_layers,
            n_kv_heads: self.shared.config.n_kv_heads,
            head_dim: self.shared.config.head_dim,
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
        // A bounded cache makes room before anything is appended.
        if let Some(p) = policy.as_deref_mut() {
            p.before_pass(kv, ids.len())?;
        }
        self.check_input(ids, positions, kv)?;
        let n = ids.len();
        let head = head_rows(logits, n);
        let has_head = head.is_some();
        self.run(
            ids,
            positions,
            vec![pass_sequence(n, kv, policy)],
            head,
            false,
        )?;
        Ok(if has_head { &self.scratch.logits } else { &[] })
    }

    /// One pass over several sequences (continuous batching): every matrix product runs
    /// once over all their tokens, so each layer's weights are read once for all of
    /// them; attention runs per sequence over its own cache. Returns the logits after
    /// the last token of each sequence that asks for them (`vocab_size` each, in order).
    /// Each row's result is the one a pass of that sequence alone gives. On a device
    /// backend too the step is one pass (one submission per turn of the stream-slot
    /// ring), each layer uploaded once for all the sequences.
    pub fn forward_batch(&mut self, mut sequences: Vec<BatchSequence<'_>>) -> Result<&[f32]> {
        if sequences.is_empty() {
            return Err(Error::EmptyInput);
        }
        for seq in sequences.iter_mut() {
            if let Some(p) = seq.policy.as_deref_mut() {
                p.before_pass(seq.kv, seq.ids.len())?;
            }
            self.check_input(seq.ids, seq.positions, seq.kv)?;
        }
        let mut ids = std::mem::take(&mut self.scratch.batch_ids);
        let mut positions = std::mem::take(&mut self.scratch.batch_positions);
        ids.clear();
        positions.clear();
        let mut picked = Vec::new();
        let mut parts = Vec::with_capacity(sequences.len());
        for seq in sequences {
            ids.extend_from_slice(seq.ids);
            positions.extend_from_slice(seq.positions);
            if seq.every_row {
                picked.extend(ids.len() - seq.ids.len()..ids.len());
            } else if seq.logits {
                picked.push(ids.len() - 1);
            }
            parts.push(pass_sequence(seq.ids.len(), seq.kv, seq.policy));
        }
        let head = match picked.as_slice() {
            [] => None,
            // Consecutive rows (a decode step: every row) need no gather.
            [first, ..] if picked.windows(2).all(|w| w[1] == w[0] + 1) => Some(HeadRows::Range {
                first: *first,
                rows: picked.len(),
            }),
            _ => Some(HeadRows::Pick(picked)),
        };
        let has_head = head.is_some();
        let r = self.run(&ids, &positions, parts, head, false);
        self.scratch.batch_ids = ids;
        self.scratch.batch_positions = positions;
        r?;
        if !has_head {
            self.scratch.logits.clear();
        }
        Ok(&self.scratch.logits)
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
        let head = head_rows(Logits::Greedy, ids.len());
        self.run(
            ids,
            positions,
            vec![pass_sequence(ids.len(), kv, policy)],
            head,
            true,
        )?
        .ok_or_else(|| Error::Gpu {
            what: "the device pass returned no greedy id".into(),
        })
    }

    /// The ops of a pass over `n` tokens, as this handle would run it with `policy`:
    /// for inspection, dumps and tests (every tensor and weight is named).
    pub fn pass_graph(&self, n: usize, logits: Logits, policy: Option<&dyn KvPolicy>) -> Graph {
        self.build(&GraphKey {
            tokens: n,
            head: head_rows(logits, n),
            greedy: logits == Logits::Greedy,
            policy_between_layers: policy.is_some_and(|p| p.acts_between_layers()),
        })
    }

    /// The pass `key` describes, as the architecture's builder emits it.
    fn build(&self, key: &GraphKey) -> Graph {
        let config = &self.shared.config;
        let pass = Pass {
            tokens: key.tokens,
            head: key.head.as_ref(),
            greedy: key.greedy,
            policy_between_layers: key.policy_between_layers,
        };
        config.arch.build(config, &pass, self.ffn.as_ref())
    }

    /// Runs the pass: on the backend's device as one recording when it has one (the MLP
    /// lever's host sync points are served there), else, or when a KV policy acts
    /// between layers, op by op on host activations.
    fn run(
        &mut self,
        ids: &[u32],
        positions: &[u32],
        mut sequences: Vec<PassSequence<'_>>,
        head: Option<HeadRows>,
        greedy: bool,
    ) -> Result<Option<u32>> {
        let key = GraphKey {
            tokens: ids.len(),
            head,
            greedy,
            policy_between_layers: sequences
                .iter()
                .any(|s| s.policy.as_deref().is_some_and(|p| p.acts_between_layers())),
        };
        let graph = match &self.scratch.graph {
            Some((k, g)) if *k == key => g.clone(),
            _ => {
                let g = Arc::new(self.build(&key));
                self.scratch.graph = Some((key, g.clone()));
                g
            }
        };
        let shared = &self.shared;
        let pass = shared.passes.next();
        let store = &shared.store;
        let globals = store.globals();
        let mut layers = |l| store.layer(pass, l);
        // A policy between layers edits the host cache mid-pass; that pass runs here.
        let policy_sync = graph
            .ops()
            .iter()
            .any(|op| matches!(op, Op::KvPolicy { .. }));
        if let Some(device) = shared.backend.executor() {
            if !policy_sync {
                let input = DeviceForwardInput {
                    globals,
                    ids,
                    positions,
                };
                return device.forward(
                    &graph,
                    &input,
                    &mut layers,
                    &mut sequences,
                    self.ffn.as_mut(),
                    &mut self.scratch.logits,
                );
            }
        }
        let s = &mut self.scratch;
        graph::run_on_host(
            &graph,
            shared.backend.as_ref(),
            HostPass {
                ids,
                positions,
                globals,
                layers: &mut layers,
                sequences,
                ffn: self.ffn.as_mut(),
            },
            &mut s.buffers,
        )?;
        let Some(out) = graph.logits() else {
            s.logits.clear();
            return Ok(None);
        };
        let values = &s.buffers[out.index()];
        if graph.greedy() {
            return Ok(Some(crate::sampler::argmax(values)));
        }
        s.logits.clear();
        s.logits.extend_from_slice(values);
        Ok(None)
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
}

/// The rows of a pass over `n` tokens whose logits `logits` asks for.
fn head_rows(logits: Logits, n: usize) -> Option<HeadRows> {
    match logits {
        Logits::None => None,
        Logits::Last | Logits::Greedy => Some(HeadRows::Range {
            first: n - 1,
            rows: 1,
        }),
        Logits::All => Some(HeadRows::Range { first: 0, rows: n }),
    }
}

/// A pass's sequence of `rows` tokens over `kv`.
fn pass_sequence<'a, 'k: 'a, 'p: 'a>(
    rows: usize,
    kv: &'a mut (dyn KvCache + 'k),
    policy: Option<&'a mut (dyn KvPolicy + 'p)>,
) -> PassSequence<'a> {
    PassSequence {
        rows,
        kv,
        // Re-wrapped so the trait object's lifetime may shorten to the pass's.
        policy: match policy {
            Some(p) => Some(p),
            None => None,
        },
    }
}
