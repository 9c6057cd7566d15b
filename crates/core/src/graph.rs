//! The forward pass as a list of ops over tensor handles: what an architecture's
//! builder emits once (`ballast_runtime::model`), and what every backend executes.
//!
//! A [`Graph`] holds the activation tensors of one pass (token-major f32 rows, each
//! with a name for dumps and errors) and the [`Op`]s over them, in order. Weights are
//! named, not held: an op refers to a tensor of the current layer's table or of the
//! global weights by its GGUF role ([`WeightRef`]), and the executor resolves it when
//! it reaches the op. Layers come one at a time from the store between
//! [`Op::BeginLayer`] and [`Op::EndLayer`], so a streaming store gets each layer's slot
//! back before the next is asked for.
//!
//! Two executors exist: [`run_on_host`] runs the list eagerly through the [`Backend`]
//! ops on host memory (the CPU backend, and any backend when the pass has host sync
//! points); a device backend records it whole ([`crate::backend::DeviceExecutor`]).
//! Ops that must look at host data (a lever's MLP, a KV policy acting between layers)
//! are host sync points ([`Op::is_host_sync`]).
//!
//! ```
//! use ballast_core::graph::{Graph, Op, WeightRef};
//!
//! let mut g = Graph::new(2);
//! let x = g.tensor("x", 2, 8);
//! let y = g.tensor("y", 2, 4);
//! g.push(Op::Matmul { x, jobs: vec![(WeightRef::layer("attn_q.weight"), y)] });
//! assert_eq!(g.ops().len(), 1);
//! assert_eq!(g.desc(y).len(), 8);
//! ```

use std::sync::Arc;

use crate::backend::{AttentionShape, Backend, LayerSource, MatmulJob, Rope};
use crate::config::MoeSpec;
use crate::error::{Error, Result};
use crate::ffn::FeedForward;
use crate::kv::{KvCache, KvPolicy};
use crate::weights::{GlobalWeights, LayerWeights, Weight};

/// A handle to one activation tensor of a [`Graph`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TensorId(usize);

impl TensorId {
    /// The tensor's index in [`Graph::tensors`].
    pub fn index(self) -> usize {
        self.0
    }
}

/// An activation tensor: `rows × width` f32 values, token-major.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorDesc {
    /// What it holds (`attn_norm`, `q`, `ffn_gate`, ...), for dumps and errors.
    pub name: &'static str,
    /// Rows (tokens).
    pub rows: usize,
    /// Values per row.
    pub width: usize,
}

impl TensorDesc {
    /// Values in the tensor.
    pub fn len(&self) -> usize {
        self.rows * self.width
    }

    /// True if the tensor holds no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Where a weight comes from: the current layer's table or the global weights, by the
/// role its GGUF name gives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightRef {
    /// `blk.N.<role>` of the layer between [`Op::BeginLayer`] and [`Op::EndLayer`].
    Layer(&'static str),
    /// A tensor outside the blocks (`token_embd.weight`, `output.weight`,
    /// `output_norm.weight`).
    Global(&'static str),
}

impl WeightRef {
    /// A tensor of the current layer.
    pub fn layer(role: &'static str) -> WeightRef {
        WeightRef::Layer(role)
    }

    /// A tensor outside the blocks.
    pub fn global(role: &'static str) -> WeightRef {
        WeightRef::Global(role)
    }

    /// The matrix this names.
    pub fn matrix<'w>(
        self,
        globals: &'w GlobalWeights,
        layer: Option<&'w LayerWeights>,
    ) -> Result<&'w Weight> {
        match self {
            WeightRef::Global(role) => globals.matrix(role),
            WeightRef::Layer(role) => current(layer, role)?.matrix(role),
        }
    }

    /// The vector this names; `None` if the layer has none of this role.
    pub fn find_vector<'w>(
        self,
        globals: &'w GlobalWeights,
        layer: Option<&'w LayerWeights>,
    ) -> Result<Option<&'w Arc<[f32]>>> {
        match self {
            WeightRef::Global(role) => globals.vector(role).map(Some),
            WeightRef::Layer(role) => Ok(current(layer, role)?.find_vector(role)),
        }
    }

    /// The vector this names, or an error naming it.
    pub fn vector<'w>(
        self,
        globals: &'w GlobalWeights,
        layer: Option<&'w LayerWeights>,
    ) -> Result<&'w Arc<[f32]>> {
        match self {
            WeightRef::Global(role) => globals.vector(role),
            WeightRef::Layer(role) => current(layer, role)?.vector(role),
        }
    }
}

fn current<'w>(layer: Option<&'w LayerWeights>, role: &str) -> Result<&'w LayerWeights> {
    layer.ok_or_else(|| Error::InvalidArgument {
        what: format!("op asks for layer tensor '{role}' outside BeginLayer/EndLayer"),
    })
}

/// One op of a forward pass. Activations are [`TensorId`]s; weights are
/// [`WeightRef`]s, resolved by the executor.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// Rows of the embedding table `table` for the pass's token ids, into `out`.
    Embed {
        /// The table.
        table: WeightRef,
        /// `n_tokens × cols`.
        out: TensorId,
    },
    /// Takes layer `layer`'s weights from the store; [`WeightRef::Layer`] refers to
    /// them until [`Op::EndLayer`].
    BeginLayer {
        /// The layer.
        layer: usize,
    },
    /// Gives the current layer's weights back to the store.
    EndLayer,
    /// RMSNorm of each row of `x` times `scale`, into `out`.
    RmsNorm {
        /// Input.
        x: TensorId,
        /// Scale vector.
        scale: WeightRef,
        /// Epsilon.
        eps: f32,
        /// Output, same shape as `x`.
        out: TensorId,
    },
    /// RMSNorm of each `head_dim`-wide head of each row of `x` times `scale` (one value
    /// per element of a head), into `out`: the per-head Q/K norm of qwen3 and gemma3.
    HeadRmsNorm {
        /// Input, a width that is a multiple of `head_dim`.
        x: TensorId,
        /// Size of a head: the length of `scale`.
        head_dim: usize,
        /// Scale vector.
        scale: WeightRef,
        /// Epsilon.
        eps: f32,
        /// Output, same shape as `x`.
        out: TensorId,
    },
    /// Matrix products sharing the input `x` (quantized once): `out = x · weightᵀ` per
    /// job.
    Matmul {
        /// Input, `rows × cols` of every weight.
        x: TensorId,
        /// Weights and their outputs.
        jobs: Vec<(WeightRef, TensorId)>,
    },
    /// Adds the bias vector to each row of `x`; nothing if the layer has no tensor of
    /// that role (biases are optional in the architectures that have them).
    AddBias {
        /// Rows to add to.
        x: TensorId,
        /// The bias.
        bias: WeightRef,
    },
    /// Rotates each head of each row of `x` by its token's position.
    Rope {
        /// `n_tokens × n_heads·head_dim`.
        x: TensorId,
        /// Heads per row.
        n_heads: usize,
        /// Size of a head.
        head_dim: usize,
        /// Pairing, rotated dimensions, base.
        rope: Rope,
    },
    /// Writes the keys `k` and values `v` of the pass's tokens to the cache of `layer`.
    KvWrite {
        /// The layer.
        layer: usize,
        /// Keys, `n_tokens × kv_dim`.
        k: TensorId,
        /// Values, `n_tokens × kv_dim`.
        v: TensorId,
    },
    /// Host sync point: the KV policy may evict from `layer`'s cache
    /// ([`KvPolicy::before_attention`]). Emitted only for policies that act between
    /// layers.
    KvPolicy {
        /// The layer.
        layer: usize,
    },
    /// Causal attention of `q` over `layer`'s cache, into `out`.
    Attention {
        /// The layer whose cache is read.
        layer: usize,
        /// Queries.
        q: TensorId,
        /// Heads.
        shape: AttentionShape,
        /// Output, same shape as `q`.
        out: TensorId,
    },
    /// `x += y`.
    Add {
        /// Accumulator.
        x: TensorId,
        /// Addend, same shape.
        y: TensorId,
    },
    /// `out = silu(gate) * up`.
    Swiglu {
        /// Gate.
        gate: TensorId,
        /// Up.
        up: TensorId,
        /// Output.
        out: TensorId,
    },
    /// `out = gelu(gate) * up`, GELU in its tanh form (gemma's gated MLP).
    Geglu {
        /// Gate.
        gate: TensorId,
        /// Up.
        up: TensorId,
        /// Output.
        out: TensorId,
    },
    /// `x *= factor` (gemma's embedding scale, its query scale).
    Scale {
        /// Tensor scaled in place.
        x: TensorId,
        /// The factor.
        factor: f32,
    },
    /// Host sync point: the model's [`FeedForward`] lever sees `layer`'s attention input
    /// ([`FeedForward::prepare`]).
    FfnPrepare {
        /// The layer.
        layer: usize,
        /// The attention input.
        x: TensorId,
    },
    /// Host sync point: the model's [`FeedForward`] lever computes `layer`'s MLP
    /// ([`FeedForward::forward`]) from `x` into `out`.
    FeedForward {
        /// The layer.
        layer: usize,
        /// The MLP input.
        x: TensorId,
        /// Its output.
        out: TensorId,
    },
    /// The mixture-of-experts MLP of `layer` ([`crate::moe::MoeFfn`]) from `x` into
    /// `out`: router, softmax, top-k, the chosen experts' SwiGLU MLPs weighted and
    /// summed in the order of the choice, and the shared expert if `weights` has one.
    /// The host executor calls [`FeedForward::forward`] as for [`Op::FeedForward`]; a
    /// device routes on the device and multiplies only the chosen experts' rows, with no
    /// read-back, so it is not a host sync point.
    Moe {
        /// The layer.
        layer: usize,
        /// The MLP input, `n_tokens × d_model`.
        x: TensorId,
        /// Its output, same shape.
        out: TensorId,
        /// The tensors, by role.
        weights: MoeWeights,
        /// Expert counts, widths and how the chosen experts are weighted.
        spec: MoeSpec,
    },
    /// Copies the rows `rows` of `x`, in that order, into `out` (a batched pass's last
    /// row of each sequence, for the head).
    Gather {
        /// Source.
        x: TensorId,
        /// The rows copied, one per row of `out`.
        rows: Vec<usize>,
        /// Destination.
        out: TensorId,
    },
    /// Copies rows `first..first + out.rows` of `x` into `out`.
    Rows {
        /// Source.
        x: TensorId,
        /// First row copied.
        first: usize,
        /// Destination; its row count says how many rows.
        out: TensorId,
    },
}

/// The tensors of an [`Op::Moe`], by role.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeWeights {
    /// The router, `[d_model, n_expert]`: one logit per expert.
    pub router: WeightRef,
    /// The experts' gate projections stacked, `[d_model, n_ff_expert, n_expert]`.
    pub gate: WeightRef,
    /// The experts' up projections stacked, as `gate`.
    pub up: WeightRef,
    /// The experts' down projections stacked, `[n_ff_expert, d_model, n_expert]`.
    pub down: WeightRef,
    /// qwen2moe's shared expert.
    pub shared: Option<SharedExpertWeights>,
}

/// qwen2moe's shared expert: a SwiGLU MLP every token runs, times the sigmoid of a
/// per-token gate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedExpertWeights {
    /// The gate's weights, a vector of `d_model`.
    pub gate_inp: WeightRef,
    /// Gate projection, `[d_model, n_ff_shared]`.
    pub gate: WeightRef,
    /// Up projection, as `gate`.
    pub up: WeightRef,
    /// Down projection, `[n_ff_shared, d_model]`.
    pub down: WeightRef,
}

impl Op {
    /// True for ops that must see host data (a lever's MLP, a KV policy between
    /// layers): a device executor stops there, or hands the pass to the host executor.
    pub fn is_host_sync(&self) -> bool {
        matches!(
            self,
            Op::KvPolicy { .. } | Op::FfnPrepare { .. } | Op::FeedForward { .. }
        )
    }
}

/// The tensors and ops of one forward pass over `n_tokens` tokens.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Graph {
    n_tokens: usize,
    tensors: Vec<TensorDesc>,
    ops: Vec<Op>,
    logits: Option<TensorId>,
    greedy: bool,
}

impl Graph {
    /// An empty pass over `n_tokens` tokens.
    pub fn new(n_tokens: usize) -> Graph {
        Graph {
            n_tokens,
            ..Graph::default()
        }
    }

    /// Tokens in the pass.
    pub fn n_tokens(&self) -> usize {
        self.n_tokens
    }

    /// A new tensor of `rows × width`.
    pub fn tensor(&mut self, name: &'static str, rows: usize, width: usize) -> TensorId {
        self.tensors.push(TensorDesc { name, rows, width });
        TensorId(self.tensors.len() - 1)
    }

    /// The tensor named `name` of `rows × width`, made on first use. Blocks ask for
    /// their intermediates this way, so every layer reuses the same buffers.
    pub fn scratch(&mut self, name: &'static str, rows: usize, width: usize) -> TensorId {
        let want = TensorDesc { name, rows, width };
        match self.tensors.iter().position(|t| *t == want) {
            Some(i) => TensorId(i),
            None => self.tensor(name, rows, width),
        }
    }

    /// Appends an op.
    pub fn push(&mut self, op: Op) {
        self.ops.push(op);
    }

    /// Marks `logits` as the pass's output; with `greedy`, only the argmax of its last
    /// row is wanted.
    pub fn set_output(&mut self, logits: TensorId, greedy: bool) {
        self.logits = Some(logits);
        self.greedy = greedy;
    }

    /// The ops, in order.
    pub fn ops(&self) -> &[Op] {
        &self.ops
    }

    /// Every tensor of the pass.
    pub fn tensors(&self) -> &[TensorDesc] {
        &self.tensors
    }

    /// The shape of `t`.
    pub fn desc(&self, t: TensorId) -> &TensorDesc {
        &self.tensors[t.0]
    }

    /// The logits tensor, if the pass computes logits.
    pub fn logits(&self) -> Option<TensorId> {
        self.logits
    }

    /// True if only the greedy id of the last row of logits is wanted.
    pub fn greedy(&self) -> bool {
        self.greedy
    }

    /// Host sync points in the pass.
    pub fn host_syncs(&self) -> usize {
        self.ops.iter().filter(|op| op.is_host_sync()).count()
    }
}

/// One op per line, tensors by name and shape, weights by role: how the builder
/// composed the pass (`ballast inspect --graph` prints it).
impl std::fmt::Display for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let t = |id: &TensorId| {
            let d = self.desc(*id);
            format!("{}[{}x{}]", d.name, d.rows, d.width)
        };
        let mut layer: Option<usize> = None;
        for op in &self.ops {
            match op {
                Op::BeginLayer { layer: l } => layer = Some(*l),
                Op::EndLayer => layer = None,
                _ => {}
            }
            let w = |r: &WeightRef| match (r, layer) {
                (WeightRef::Layer(role), Some(l)) => format!("blk.{l}.{role}"),
                (WeightRef::Layer(role), None) => format!("blk.?.{role}"),
                (WeightRef::Global(role), _) => role.to_string(),
            };
            let depth = usize::from(layer.is_some() && !matches!(op, Op::BeginLayer { .. }));
            let line = match op {
                Op::Embed { table, out } => format!("{} = embed({})", t(out), w(table)),
                Op::BeginLayer { layer } => format!("layer {layer}:"),
                Op::EndLayer => "end layer".to_string(),
                Op::RmsNorm { x, scale, eps, out } => {
                    format!("{} = rms_norm({}, {}, eps {eps})", t(out), t(x), w(scale))
                }
                Op::HeadRmsNorm {
                    x,
                    head_dim,
                    scale,
                    eps,
                    out,
                } => format!(
                    "{} = rms_norm per head of {head_dim}({}, {}, eps {eps})",
                    t(out),
                    t(x),
                    w(scale)
                ),
                Op::Matmul { x, jobs } => jobs
                    .iter()
                    .map(|(wr, o)| format!("{} = {} · {}ᵀ", t(o), t(x), w(wr)))
                    .collect::<Vec<_>>()
                    .join("; "),
                Op::AddBias { x, bias } => format!("{} += {} (if present)", t(x), w(bias)),
                Op::Rope {
                    x,
                    n_heads,
                    head_dim,
                    rope,
                } => format!(
                    "rope({}, {n_heads} heads of {head_dim}, {:?}, {} dims, base {}, scale {})",
                    t(x),
                    rope.style,
                    rope.n_dims,
                    rope.freq_base,
                    rope.freq_scale
                ),
                Op::KvWrite { layer, k, v } => format!("kv[{layer}] <- {}, {}", t(k), t(v)),
                Op::KvPolicy { layer } => format!("host sync: kv policy before attention {layer}"),
                Op::Attention { layer, q, out, .. } => {
                    format!("{} = attention({}, kv[{layer}])", t(out), t(q))
                }
                Op::Add { x, y } => format!("{} += {}", t(x), t(y)),
                Op::Swiglu { gate, up, out } => {
                    format!("{} = silu({}) * {}", t(out), t(gate), t(up))
                }
                Op::Geglu { gate, up, out } => {
                    format!("{} = gelu({}) * {}", t(out), t(gate), t(up))
                }
                Op::Scale { x, factor } => format!("{} *= {factor}", t(x)),
                Op::FfnPrepare { layer, x } => format!("host sync: mlp prepare {layer} ({})", t(x)),
                Op::FeedForward { layer, x, out } => {
                    format!("host sync: {} = mlp {layer}({})", t(out), t(x))
                }
                Op::Moe {
                    x,
                    out,
                    weights,
                    spec,
                    ..
                } => {
                    let shared = match &weights.shared {
                        Some(s) => format!(
                            " + shared({}, {}, {}) * sigmoid({})",
                            w(&s.gate),
                            w(&s.up),
                            w(&s.down),
                            w(&s.gate_inp)
                        ),
                        None => String::new(),
                    };
                    format!(
                        "{} = {} of {} experts({}) by {}({}, {}, {}){shared}",
                        t(out),
                        spec.n_expert_used,
                        spec.n_expert,
                        t(x),
                        w(&weights.router),
                        w(&weights.gate),
                        w(&weights.up),
                        w(&weights.down),
                    )
                }
                Op::Rows { x, first, out } => format!("{} = rows of {} from {first}", t(out), t(x)),
                Op::Gather { x, rows, out } => format!("{} = rows {rows:?} of {}", t(out), t(x)),
            };
            writeln!(f, "{:indent$}{line}", "", indent = depth * 2)?;
        }
        match self.logits {
            Some(l) if self.greedy => writeln!(f, "output: argmax of {}", t(&l)),
            Some(l) => writeln!(f, "output: {}", t(&l)),
            None => writeln!(f, "output: none"),
        }
    }
}

/// Checks a [`Op::HeadRmsNorm`]: a scale of `head_dim` values, and `x` whole heads wide.
/// Every executor calls it, so a scale of the wrong size is an error naming it, never a
/// norm over rows that are not heads.
pub fn check_head_norm(
    graph: &Graph,
    x: TensorId,
    head_dim: usize,
    scale_len: usize,
) -> Result<()> {
    let d = graph.desc(x);
    if scale_len != head_dim {
        return Err(Error::ShapeMismatch {
            what: format!("per-head norm scale of {}", d.name),
            expected: head_dim,
            got: scale_len,
        });
    }
    if head_dim == 0 || d.width % head_dim != 0 {
        return Err(Error::ShapeMismatch {
            what: format!("width of {} in heads of {head_dim}", d.name),
            expected: d.width.div_ceil(head_dim.max(1)) * head_dim,
            got: d.width,
        });
    }
    Ok(())
}

/// One sequence of a pass: the next `rows` rows of the pass's tokens, with the cache
/// they append to and attend over, and its KV policy. A pass over several sequences
/// (continuous batching) computes every matrix product once over all their rows and
/// attention per sequence, each over its own cache.
pub struct PassSequence<'a> {
    /// How many consecutive rows of the pass are this sequence's.
    pub rows: usize,
    /// Its cache.
    pub kv: &'a mut dyn KvCache,
    /// Its KV policy, for [`Op::KvPolicy`].
    pub policy: Option<&'a mut dyn KvPolicy>,
}

/// What the host executor needs besides the graph: the pass's tokens, the weights, the
/// sequences with their caches, and the MLP lever.
pub struct HostPass<'a, 's, 'q> {
    /// Token ids, every sequence's in turn.
    pub ids: &'a [u32],
    /// Their positions (each sequence's own).
    pub positions: &'a [u32],
    /// Embedding table, final norm, head.
    pub globals: &'a GlobalWeights,
    /// Layers, one at a time.
    pub layers: &'a mut LayerSource<'s>,
    /// The sequences, whose rows add up to the pass's tokens.
    pub sequences: Vec<PassSequence<'q>>,
    /// The MLP lever, for [`Op::FfnPrepare`] and [`Op::FeedForward`].
    pub ffn: &'a mut dyn FeedForward,
}

/// Runs `graph` eagerly, op by op, through `backend` on host buffers (`buffers`: one per
/// tensor, kept between passes so decode allocates nothing). The logits tensor's
/// values are left in `buffers[logits.index()]`.
pub fn run_on_host(
    graph: &Graph,
    backend: &dyn Backend,
    pass: HostPass<'_, '_, '_>,
    buffers: &mut Vec<Vec<f32>>,
) -> Result<()> {
    let HostPass {
        ids,
        positions,
        globals,
        layers,
        mut sequences,
        ffn,
    } = pass;
    let n = graph.n_tokens();
    let total: usize = sequences.iter().map(|s| s.rows).sum();
    if total != n || ids.len() != n || positions.len() != n {
        return Err(Error::ShapeMismatch {
            what: "tokens, positions and sequence rows of a pass".into(),
            expected: n,
            got: if total != n {
                total
            } else {
                ids.len().min(positions.len())
            },
        });
    }
    buffers.resize_with(graph.tensors().len(), Vec::new);
    for (buf, desc) in buffers.iter_mut().zip(graph.tensors()) {
        buf.resize(desc.len(), 0.0);
    }
    let mut layer: Option<Arc<LayerWeights>> = None;
    for op in graph.ops() {
        let lw = layer.as_deref();
        match op {
            Op::Embed { table, out } => {
                backend.embed(table.matrix(globals, lw)?, ids, &mut buffers[out.0])?;
            }
            Op::BeginLayer { layer: l } => {
                // The store gets a streamed layer's slot back before the next is asked.
                drop(layer.take());
                layer = Some(layers(*l)?);
            }
            Op::EndLayer => layer = None,
            Op::RmsNorm { x, scale, eps, out } => {
                let mut o = std::mem::take(&mut buffers[out.0]);
                let r = backend.rms_norm(&buffers[x.0], scale.vector(globals, lw)?, *eps, &mut o);
                buffers[out.0] = o;
                r?;
            }
            Op::HeadRmsNorm {
                x,
                head_dim,
                scale,
                eps,
                out,
            } => {
                let scale = scale.vector(globals, lw)?;
                check_head_norm(graph, *x, *head_dim, scale.len())?;
                // The norm's rows are the heads: the scale's length sets the row length.
                let mut o = std::mem::take(&mut buffers[out.0]);
                let r = backend.rms_norm(&buffers[x.0], scale, *eps, &mut o);
                buffers[out.0] = o;
                r?;
            }
            Op::Matmul { x, jobs } => {
                let mut outs: Vec<Vec<f32>> = jobs
                    .iter()
                    .map(|(_, t)| std::mem::take(&mut buffers[t.0]))
                    .collect();
                let weights = jobs
                    .iter()
                    .map(|(w, _)| w.matrix(globals, lw))
                    .collect::<Result<Vec<_>>>();
                let r = weights.and_then(|weights| {
                    let mut batch: Vec<MatmulJob<'_>> = weights
                        .into_iter()
                        .zip(outs.iter_mut())
                        .map(|(weight, out)| MatmulJob { weight, out })
                        .collect();
                    backend.matmul(&buffers[x.0], graph.desc(*x).rows, &mut batch)
                });
                for ((_, t), o) in jobs.iter().zip(outs) {
                    buffers[t.0] = o;
                }
                r?;
            }
            Op::AddBias { x, bias } => {
                if let Some(b) = bias.find_vector(globals, lw)? {
                    backend.add_bias(&mut buffers[x.0], b)?;
                }
            }
            Op::Rope {
                x,
                n_heads,
                head_dim,
                rope,
            } => backend.rope(&mut buffers[x.0], positions, *n_heads, *head_dim, rope)?,
            Op::KvWrite { layer: l, k, v } => {
                let kw = graph.desc(*k).width;
                let vw = graph.desc(*v).width;
                let mut first = 0;
                for seq in sequences.iter_mut() {
                    let rows = first..first + seq.rows;
                    seq.kv.append(
                        *l,
                        &positions[rows.clone()],
                        &buffers[k.0][rows.start * kw..rows.end * kw],
                        &buffers[v.0][rows.start * vw..rows.end * vw],
                    )?;
                    first = rows.end;
                }
            }
            Op::KvPolicy { layer: l } => {
                for seq in sequences.iter_mut() {
                    if let Some(p) = seq.policy.as_deref_mut() {
                        p.before_attention(*l, &mut *seq.kv)?;
                    }
                }
            }
            Op::Attention {
                layer: l,
                q,
                shape,
                out,
            } => {
                let width = graph.desc(*q).width;
                let mut o = std::mem::take(&mut buffers[out.0]);
                let mut first = 0;
                let mut r = Ok(());
                for seq in sequences.iter() {
                    let rows = first..first + seq.rows;
                    let span = rows.start * width..rows.end * width;
                    r = backend.attention(
                        &buffers[q.0][span.clone()],
                        &positions[rows.clone()],
                        &seq.kv.view(*l),
                        shape,
                        &mut o[span],
                    );
                    if r.is_err() {
                        break;
                    }
                    first = rows.end;
                }
                buffers[out.0] = o;
                r?;
            }
            Op::Add { x, y } => {
                let mut acc = std::mem::take(&mut buffers[x.0]);
                let r = backend.add_assign(&mut acc, &buffers[y.0]);
                buffers[x.0] = acc;
                r?;
            }
            Op::Swiglu { gate, up, out } => {
                let mut o = std::mem::take(&mut buffers[out.0]);
                let r = backend.swiglu(&buffers[gate.0], &buffers[up.0], &mut o);
                buffers[out.0] = o;
                r?;
            }
            Op::Geglu { gate, up, out } => {
                let mut o = std::mem::take(&mut buffers[out.0]);
                let r = backend.geglu(&buffers[gate.0], &buffers[up.0], &mut o);
                buffers[out.0] = o;
                r?;
            }
            Op::Scale { x, factor } => backend.scale(&mut buffers[x.0], *factor)?,
            Op::FfnPrepare { layer: l, x } => ffn.prepare(*l, &buffers[x.0], n)?,
            // The same call for a mixture of experts: the host path is the MLP's own.
            Op::FeedForward { layer: l, x, out }
            | Op::Moe {
                layer: l, x, out, ..
            } => {
                let w = lw.ok_or_else(|| Error::InvalidArgument {
                    what: format!("FeedForward of layer {l} outside BeginLayer/EndLayer"),
                })?;
                let mut o = std::mem::take(&mut buffers[out.0]);
                let r = ffn.forward(backend, w, &buffers[x.0], n, &mut o);
                buffers[out.0] = o;
                r?;
            }
            Op::Gather { x, rows, out } => {
                let width = graph.desc(*x).width;
                let mut o = std::mem::take(&mut buffers[out.0]);
                let mut r = Ok(());
                for (dst, &row) in o.chunks_exact_mut(width).zip(rows) {
                    match buffers[x.0].get(row * width..(row + 1) * width) {
                        Some(src) => dst.copy_from_slice(src),
                        None => {
                            r = Err(Error::ShapeMismatch {
                                what: format!("row {row} of {}", graph.desc(*x).name),
                                expected: (row + 1) * width,
                                got: graph.desc(*x).len(),
                            });
                            break;
                        }
                    }
                }
                buffers[out.0] = o;
                r?;
            }
            Op::Rows { x, first, out } => {
                let width = graph.desc(*x).width;
                let len = graph.desc(*out).len();
                let start = first * width;
                let mut o = std::mem::take(&mut buffers[out.0]);
                let r = match buffers[x.0].get(start..start + len) {
                    Some(src) => {
                        o.copy_from_slice(src);
                        Ok(())
                    }
                    None => Err(Error::ShapeMismatch {
                        what: format!("rows of {}", graph.desc(*x).name),
                        expected: start + len,
                        got: graph.desc(*x).len(),
                    }),
                };
                buffers[out.0] = o;
                r?;
            }
        }
    }
    Ok(())
}
