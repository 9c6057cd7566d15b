//! The planner: which layers live on the device, in RAM or on disk, from the real byte
//! size of each layer, the budgets of each memory and the reserves the model needs.
//!
//! # Placement rule
//!
//! 1. The output head and the final norm are read whole by every token, so they are
//!    placed first, on the device (counted in the device reserve). The embedding table
//!    is not placed: a token reads one row of it, so it stays memory-mapped and costs
//!    `embd_row_bytes` per token. (A model that ties its head to the embedding has no
//!    separate table.) On the CPU backend, a budget too small for the head beside one
//!    streaming slot leaves the head on disk ([`Plan::head_on_disk`]): it stays
//!    memory-mapped and the kernel pages it in, whatever of it the page cache does not
//!    keep, on every token. A batch of sequences reads it once for all of them.
//! 2. Every layer is read once per token whatever tier holds it, so the bytes moved per
//!    token depend only on how many bytes are not resident. The planner therefore keeps
//!    as many layers as fit on the device, then in RAM, and streams the rest.
//! 3. Which layers stream is not "the last ones": the streamed layers are spread evenly
//!    over the depth of the model. A streamed layer's transfer then overlaps the
//!    compute of the resident layers before it, so a shallow ring of slots keeps the
//!    link busy; a contiguous run of streamed layers would leave the link idle while
//!    the resident run computes and make the compute wait during the streamed run.
//! 4. Streaming needs slots: `depth` device slots of the largest streamed layer (and,
//!    with a separate device, `depth` RAM staging buffers for layers read from disk).
//!    Slots are taken from the budget before resident layers. If `depth` slots do not
//!    fit, the depth shrinks (down to one slot, no overlap); if one slot does not fit,
//!    planning fails with [`Error::BudgetTooSmall`], which says how much is needed.
//!
//! On the CPU backend the device is RAM: [`Budgets::device`] is `None`, tiers A and B
//! are one pool, layers are either resident ([`Tier::Device`]) or read from disk into
//! slots in RAM ([`Tier::Disk`]), and nothing is uploaded.
//!
//! All sums saturate: absurd sizes give "does not fit", never an overflow.

use crate::{Error, Result};

/// Alignment of slot buffers and of reads from disk (direct I/O wants the logical
/// block size; 4 KiB covers every common device).
pub const IO_ALIGN: u64 = 4096;

/// Rounds `n` up to a multiple of [`IO_ALIGN`], saturating.
pub fn align_up(n: u64) -> u64 {
    n.saturating_add(IO_ALIGN - 1) / IO_ALIGN * IO_ALIGN
}

/// Bytes of a slot that holds a layer of `layer_bytes`: the aligned size plus two
/// blocks, for a read that starts and ends mid-block and the padding between tensors.
pub fn slot_bytes(layer_bytes: u64) -> u64 {
    align_up(layer_bytes).saturating_add(2 * IO_ALIGN)
}

/// What the planner needs to know about a model.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelShape {
    /// Real byte size of each layer's tensors, in layer order.
    pub layer_bytes: Vec<u64>,
    /// Output head and final norm: read whole by every token.
    pub head_bytes: u64,
    /// Bytes of one row of the embedding table (read per token from the memory map).
    pub embd_row_bytes: u64,
    /// Residual width.
    pub d_model: u64,
    /// Query heads times head size.
    pub q_dim: u64,
    /// Key/value heads times head size.
    pub kv_dim: u64,
    /// MLP width.
    pub n_ff: u64,
    /// Vocabulary size.
    pub vocab: u64,
    /// Bytes per cached key or value (the runtime's `DenseKv` stores f16 by default: 2).
    pub kv_value_bytes: u64,
    /// With a separate device, whether the KV cache lives there alone (a device cache,
    /// read back only on demand) rather than also as a complete record in host RAM.
    pub kv_on_device_only: bool,
    /// Bytes of each layer's stacked expert tensors (a mixture of experts; empty or
    /// zeros for a dense model). On the CPU a streamed layer reads only the experts
    /// its tokens choose, so its slot holds the rest of the layer.
    pub expert_bytes: Vec<u64>,
    /// The share of a layer's experts one token uses (`expert_used_count /
    /// expert_count`; 1 for a dense model).
    pub expert_share: f64,
    /// Bytes a streamed layer reads from storage when they differ from `layer_bytes`
    /// (a compressed pack: its stored chunks); empty: `layer_bytes`.
    pub stored_bytes: Vec<u64>,
    /// Decoded bytes per second of the store beneath, which decodes each streamed
    /// layer after reading it (a pack; 0: nothing to decode).
    pub decode_bytes_per_s: f64,
    /// Reader threads that read and decode streamed layers (a pack's): each decodes
    /// a piece of its layer between its reads while the others read, so decoding
    /// overlaps the disk when there are two or more. 0 counts as 1.
    pub decode_readers: usize,
    /// Each layer's sliding window when its KV cache keeps only that (gemma3's local
    /// layers, in a cache that drops what no later query sees); empty or `None`: the
    /// layer keeps every token.
    pub kv_windows: Vec<Option<u64>>,
}

impl ModelShape {
    /// A model of `n_layers` identical layers described by its dimensions, with
    /// weights of `bits_per_weight` bits (e.g. 6.5625 for Q6_K): what `ballast plan`
    /// uses for a model the user does not have.
    #[allow(clippy::too_many_arguments)]
    pub fn from_dims(
        n_layers: u64,
        d_model: u64,
        n_heads: u64,
        n_kv_heads: u64,
        n_ff: u64,
        vocab: u64,
        bits_per_weight: f64,
        head_bits_per_weight: f64,
    ) -> ModelShape {
        let head_dim = d_model / n_heads.max(1);
        let q_dim = n_heads * head_dim;
        let kv_dim = n_kv_heads * head_dim;
        let params = d_model * q_dim + 2 * d_model * kv_dim + q_dim * d_model + 3 * d_model * n_ff;
        let weight_bytes = (params as f64 * bits_per_weight / 8.0).ceil() as u64;
        let norms = 2 * d_model * 4;
        ModelShape {
            layer_bytes: vec![weight_bytes + norms; n_layers as usize],
            head_bytes: (d_model as f64 * vocab as f64 * head_bits_per_weight / 8.0).ceil() as u64
                + d_model * 4,
            embd_row_bytes: (d_model as f64 * head_bits_per_weight / 8.0).ceil() as u64,
            d_model,
            q_dim,
            kv_dim,
            n_ff,
            vocab,
            kv_value_bytes: ballast_core::kv::KvElement::default().row_bytes(1) as u64,
            kv_on_device_only: false,
            expert_bytes: Vec::new(),
            expert_share: 1.0,
            stored_bytes: Vec::new(),
            decode_bytes_per_s: 0.0,
            decode_readers: 1,
            kv_windows: Vec::new(),
        }
    }

    /// Number of layers.
    pub fn n_layers(&self) -> usize {
        self.layer_bytes.len()
    }

    /// Bytes of layer `i` a token's compute reads: all of a dense layer; of a mixture of
    /// experts, the layer less the experts the router does not choose.
    pub fn computed_layer_bytes(&self, i: usize) -> u64 {
        let whole = self.layer_bytes.get(i).copied().unwrap_or(0);
        let experts = self.expert_bytes.get(i).copied().unwrap_or(0).min(whole);
        let share = self.expert_share.clamp(0.0, 1.0);
        whole - (experts as f64 * (1.0 - share)).floor() as u64
    }

    /// Bytes of experts a streamed layer holds while a pass of `batch` tokens computes
    /// it: those its tokens choose, read when the router has run (`batch` tokens choose
    /// at most `batch` x the share each; a prompt chunk of 512 tokens chooses nearly
    /// all of a layer's 128). The largest layer's; nothing for a dense model.
    pub fn expert_working_set(&self, batch: u64) -> u64 {
        let largest = self.expert_bytes.iter().copied().max().unwrap_or(0);
        let share = (batch.max(1) as f64 * self.expert_share.clamp(0.0, 1.0)).min(1.0);
        (largest as f64 * share).ceil() as u64
    }

    /// Sum of [`ModelShape::computed_layer_bytes`] over the layers.
    pub fn total_computed_bytes(&self) -> u64 {
        (0..self.n_layers()).fold(0u64, |a, i| a.saturating_add(self.computed_layer_bytes(i)))
    }

    /// Sum of the layers' bytes.
    pub fn total_layer_bytes(&self) -> u64 {
        self.layer_bytes
            .iter()
            .fold(0u64, |a, &b| a.saturating_add(b))
    }

    /// Bytes of keys and values one layer holds per cached token.
    pub fn kv_bytes_per_token_layer(&self) -> u64 {
        2u64.saturating_mul(self.kv_dim)
            .saturating_mul(self.kv_value_bytes)
    }

    /// Tokens layer `layer`'s KV cache holds at `ctx` tokens of context fed in passes
    /// of `batch`: all of them, or for a windowed layer its window plus one pass
    /// (`window - 1 + batch`, as the runtime's windowed cache keeps).
    pub fn kv_tokens_held(&self, layer: usize, ctx: u64, batch: u64) -> u64 {
        match self.kv_windows.get(layer).copied().flatten() {
            Some(w) => w.saturating_sub(1).saturating_add(batch.max(1)).min(ctx),
            None => ctx,
        }
    }

    /// Bytes of the whole KV cache at `ctx` tokens of context fed in passes of
    /// `batch`.
    pub fn kv_bytes(&self, ctx: u64, batch: u64) -> u64 {
        (0..self.n_layers()).fold(0u64, |sum, l| {
            sum.saturating_add(
                self.kv_tokens_held(l, ctx, batch)
                    .saturating_mul(self.kv_bytes_per_token_layer()),
            )
        })
    }
}

/// What the model needs besides its layers, per memory pool. Computed from the model
/// and the context by [`Reserve::for_context`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reserve {
    /// KV cache at full context: per layer its tokens held (the context, or a windowed
    /// layer's window plus one pass) x 2 x kv_dim x value bytes.
    pub kv: u64,
    /// Activations of one forward pass of `batch` tokens (residual, q, k, v,
    /// attention output, the MLP's gate and up, f32) and one row of logits.
    pub activations: u64,
    /// Quantized copies of the activations, the sampler's candidate list, and the
    /// experts a streamed layer's tokens chose ([`ModelShape::expert_working_set`]).
    pub scratch: u64,
    /// Safety margin ([`Reserve::margin_for`]).
    pub margin: u64,
}

impl Reserve {
    /// The reserve of a pool of `budget` bytes that holds the KV cache and the
    /// activations of a model with `shape`, at `ctx` tokens of context and prompt
    /// chunks of `batch` tokens.
    pub fn for_context(shape: &ModelShape, ctx: u64, batch: u64, budget: u64) -> Reserve {
        let kv = shape.kv_bytes(ctx, batch);
        let per_token = 3u64
            .saturating_mul(shape.d_model)
            .saturating_add(2u64.saturating_mul(shape.q_dim))
            .saturating_add(2u64.saturating_mul(shape.kv_dim))
            .saturating_add(2u64.saturating_mul(shape.n_ff));
        let activations = 4u64
            .saturating_mul(batch.max(1))
            .saturating_mul(per_token)
            .saturating_add(4u64.saturating_mul(shape.vocab));
        let scratch = 2u64
            .saturating_mul(batch.max(1))
            .saturating_mul(shape.d_model.saturating_add(shape.n_ff))
            .saturating_add(12u64.saturating_mul(shape.vocab))
            .saturating_add(shape.expert_working_set(batch));
        Reserve {
            kv,
            activations,
            scratch,
            margin: Reserve::margin_for(budget),
        }
    }

    /// The safety margin of a pool of `budget` bytes: 8 MiB plus 2% of it (allocator
    /// slack, fragmentation), and 2% more up to 32 MiB for the file pages a run keeps
    /// using (the binary's code, the model file's pages read through its map), which a
    /// memory cgroup charges like the process's own memory. Without that last part an
    /// 8B-shaped model in a 2 GiB cgroup planned its memory within 8 MiB of the limit
    /// (anonymous memory 2,030 MiB, 38 MiB of it beyond the plan's items), and the
    /// kernel evicted the code to make room and read it back: a 2,000-token prompt read
    /// 147 GB from storage, or was killed.
    pub fn margin_for(budget: u64) -> u64 {
        let part = budget / 50;
        (8u64 << 20)
            .saturating_add(part)
            .saturating_add(part.min(32 << 20))
    }

    /// The reserve of the RAM pool when the device is separate: the activations live on
    /// the device; `kv` is what the host keeps of the KV cache (the complete record when
    /// the device mirrors a host cache, nothing when the cache lives on the device
    /// alone); and a margin.
    pub fn host_of_device(kv: u64, budget: u64) -> Reserve {
        Reserve {
            kv,
            margin: Reserve::margin_for(budget),
            ..Reserve::default()
        }
    }

    /// The sum, saturating.
    pub fn total(&self) -> u64 {
        self.kv
            .saturating_add(self.activations)
            .saturating_add(self.scratch)
            .saturating_add(self.margin)
    }
}

/// Bytes each memory may hold for this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budgets {
    /// Device memory, or `None` when the backend computes from RAM (CPU): then the
    /// device tier is RAM and there is no separate RAM tier.
    pub device: Option<u64>,
    /// Host RAM.
    pub ram: u64,
}

/// Where a layer lives between uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tier {
    /// Tier A: resident where the backend computes (GPU memory; RAM on the CPU).
    Device,
    /// Tier B: resident in host RAM in a form the compute does not read, and passed
    /// through a slot per use: with a separate device, uploaded to a device slot; on
    /// the CPU (a unified plan, [`Plan::ram_coded`]), held coded and decoded into a
    /// slot.
    Ram,
    /// Tier C: read from the model file per use.
    Disk,
}

impl Tier {
    /// Short name for tables.
    pub fn name(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Ram => "ram",
            Tier::Disk => "disk",
        }
    }
}

/// In what form the layers a CPU plan keeps in memory are held, when the store beneath
/// can hand out a smaller coded form of each layer ([`ModelShape::stored_bytes`]: a
/// compressed pack). A coded layer is held as its stored bytes ([`Tier::Ram`] in a
/// unified plan) and decoded per use into a slot by the reader threads, ahead of the
/// forward pass, as a layer read from disk is: it costs a decode per token instead of a
/// disk read, and its stored size instead of its raw size in the budget.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RamTier {
    /// Every kept layer decoded (resident, [`Tier::Device`]); the others stream from
    /// disk.
    #[default]
    Raw,
    /// Every kept layer coded: the most layers in the budget and the fewest disk bytes
    /// per token, for a decode of every layer on every token.
    Coded,
    /// Decoded layers first, as [`RamTier::Raw`] places them; what is left of the budget
    /// holds streamed layers coded instead of reading them from disk. Never more
    /// decodes per token than `Raw` (those layers were decoded after their read anyway),
    /// never fewer layers in memory.
    RawThenCoded,
}

impl RamTier {
    /// Short name for tables.
    pub fn name(self) -> &'static str {
        match self {
            RamTier::Raw => "raw",
            RamTier::Coded => "coded",
            RamTier::RawThenCoded => "raw then coded",
        }
    }
}

/// What the planner is asked.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanRequest {
    /// The model.
    pub shape: ModelShape,
    /// The budgets.
    pub budgets: Budgets,
    /// Context size in tokens (sizes the KV cache).
    pub ctx: u64,
    /// Prompt tokens per forward pass (sizes the activations).
    pub batch: u64,
    /// Wanted prefetch depth: slots in the ring (at least 1; 2 is double buffering).
    /// Kept whenever some split allows it, even at the cost of resident layers.
    pub depth: usize,
    /// The form of the layers kept in memory (only a CPU plan over a store with a coded
    /// form holds layers coded; otherwise this is ignored).
    pub ram_tier: RamTier,
}

/// A placement of every layer, with the slots and reserves it assumes.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// Tier of each layer.
    pub tiers: Vec<Tier>,
    /// Whether the device is RAM (CPU backend).
    pub unified: bool,
    /// The budgets planned for.
    pub budgets: Budgets,
    /// Reserve of the device pool (the RAM pool when unified).
    pub device_reserve: Reserve,
    /// Reserve of the RAM pool (zero when unified).
    pub ram_reserve: Reserve,
    /// Output head and final norm: resident on the device, or on disk when
    /// `head_on_disk`.
    pub head_bytes: u64,
    /// The head does not fit the (unified) budget beside the reserve and one slot: it
    /// stays memory-mapped and is read from disk by every token (as the page cache
    /// allows), counted in [`BytesPerToken::disk`].
    pub head_on_disk: bool,
    /// Slots of the ring on the device (0 when nothing streams).
    pub device_slots: usize,
    /// Size of one device slot (the largest streamed layer, aligned).
    pub device_slot_bytes: u64,
    /// RAM staging buffers for layers read from disk before upload (separate device
    /// only).
    pub staging_slots: usize,
    /// Size of one staging buffer.
    pub staging_slot_bytes: u64,
    /// The depth asked for (the ring may be shallower if the budget is short).
    pub requested_depth: usize,
    /// Real byte size of each layer.
    pub layer_bytes: Vec<u64>,
    /// Bytes of each layer a token's compute reads ([`ModelShape::computed_layer_bytes`]).
    pub computed_bytes: Vec<u64>,
    /// Bytes of keys and values per cached token per layer (for the attention cost).
    pub kv_bytes_per_token_layer: u64,
    /// Each layer's sliding window when its cache keeps only that (attention then
    /// reads at most the window); see [`ModelShape::kv_windows`].
    pub kv_windows: Vec<Option<u64>>,
    /// Bytes of one embedding row.
    pub embd_row_bytes: u64,
    /// Bytes of each layer's experts read one by one when it streams (zeros for a
    /// dense model, or with a separate device).
    pub expert_bytes: Vec<u64>,
    /// The share of those a token reads (see [`ModelShape::expert_share`]).
    pub expert_share: f64,
    /// See [`ModelShape::stored_bytes`].
    pub stored_bytes: Vec<u64>,
    /// See [`ModelShape::decode_bytes_per_s`].
    pub decode_bytes_per_s: f64,
    /// See [`ModelShape::decode_readers`].
    pub decode_readers: usize,
    /// [`Tier::Ram`] layers are held coded ([`ModelShape::stored_bytes`]) and decoded
    /// into a slot per use (a unified plan; see [`RamTier`]).
    pub ram_coded: bool,
}

/// Indices of `k` of `n` layers spread evenly over `0..n`.
pub fn spread(n: usize, k: usize) -> Vec<usize> {
    let k = k.min(n);
    (0..k).map(|j| ((2 * j + 1) * n) / (2 * k)).collect()
}

fn sum_of(sizes: &[u64], idx: impl Iterator<Item = usize>) -> u64 {
    idx.fold(0u64, |a, i| a.saturating_add(sizes[i]))
}

/// Picks which of `candidates` (layer indices, in order) stay resident in a pool of
/// `avail` bytes when the rest streams through `depth` slots of that pool. Returns the
/// streamed ones (a subset of `candidates`), the depth used and the slot size.
fn split(
    sizes: &[u64],
    slot_sizes: &[u64],
    candidates: &[usize],
    avail: u64,
    depth: usize,
) -> Option<(Vec<usize>, usize, u64)> {
    let all = sum_of(sizes, candidates.iter().copied());
    if all <= avail {
        return Some((Vec::new(), 0, 0));
    }
    let n = candidates.len();
    // The full depth if any split allows it (overlap is worth more than one more
    // resident layer), else shallower rings.
    for d in (1..=depth.max(1)).rev() {
        for k in 1..=n {
            let streamed: Vec<usize> = spread(n, k).into_iter().map(|j| candidates[j]).collect();
            let slot = streamed
                .iter()
                .map(|&i| slot_bytes(slot_sizes[i]))
                .max()
                .unwrap_or(0);
            let resident = all.saturating_sub(sum_of(sizes, streamed.iter().copied()));
            if resident.saturating_add(slot.saturating_mul(d as u64)) <= avail {
                return Some((streamed, d, slot));
            }
        }
    }
    None
}

/// Every layer of `sizes` streamed through `depth` slots (or fewer) of a pool of
/// `avail` bytes, none resident: [`RamTier::Coded`]'s split, before its coded layers
/// are chosen. Returns the streamed layers, the depth used and the slot size.
fn split_all_streamed(
    slot_sizes: &[u64],
    avail: u64,
    depth: usize,
) -> Option<(Vec<usize>, usize, u64)> {
    let slot = slot_sizes.iter().map(|&b| slot_bytes(b)).max()?;
    (1..=depth.max(1))
        .rev()
        .find(|&d| slot.saturating_mul(d as u64) <= avail)
        .map(|d| ((0..slot_sizes.len()).collect(), d, slot))
}

/// Of the `streamed` layers, the most that can be held coded in `room` bytes (their
/// `stored` sizes), the others left to disk spread evenly among them (so disk reads
/// stay apart in the pass, as [`spread`] keeps streamed layers apart).
fn held_coded(streamed: &[usize], stored: &[u64], room: u64) -> Vec<usize> {
    let k = streamed.len();
    for coded in (1..=k).rev() {
        let on_disk: Vec<usize> = spread(k, k - coded);
        let held: Vec<usize> = (0..k)
            .filter(|j| !on_disk.contains(j))
            .map(|j| streamed[j])
            .collect();
        if sum_of(stored, held.iter().copied()) <= room {
            return held;
        }
    }
    Vec::new()
}

/// The longest context, at most `req.ctx` tokens, for which [`plan()`] places the
/// model within `req.budgets`, or `None` if not even one token fits. What a refused
/// context should be told: the KV cache grows with the context. A pass never holds
/// more tokens than the context, so the batch is taken as at most the context tried;
/// everything else is as asked.
pub fn largest_context(req: &PlanRequest) -> Option<u64> {
    let fits = |ctx: u64| {
        plan(&PlanRequest {
            ctx,
            batch: req.batch.min(ctx),
            ..req.clone()
        })
        .is_ok()
    };
    if fits(req.ctx) {
        return Some(req.ctx);
    }
    // What is needed grows with the context: bisect between a context that fits
    // (`lo`, or none) and one that does not (`hi`).
    let (mut lo, mut hi) = (0u64, req.ctx);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    (lo > 0).then_some(lo)
}

/// Places every layer of `req.shape` within `req.budgets`.
pub fn plan(req: &PlanRequest) -> Result<Plan> {
    let shape = &req.shape;
    let sizes = &shape.layer_bytes;
    let n = sizes.len();
    // What a streamed layer's slot holds: on the CPU, the layer without its experts.
    let expert_bytes: Vec<u64> = if req.budgets.device.is_none() {
        (0..n)
            .map(|i| {
                shape
                    .expert_bytes
                    .get(i)
                    .copied()
                    .unwrap_or(0)
                    .min(sizes[i])
            })
            .collect()
    } else {
        vec![0; n]
    };
    let slot_sizes: Vec<u64> = (0..n).map(|i| sizes[i] - expert_bytes[i]).collect();
    let max_slot = slot_sizes.iter().map(|&b| slot_bytes(b)).max().unwrap_or(0);
    let device_budget = req.budgets.device.unwrap_or(req.budgets.ram);
    let device_reserve = Reserve::for_context(shape, req.ctx, req.batch, device_budget);
    // The head goes first, unless on the CPU it leaves no room for one slot: then it
    // stays mapped on disk, which beats refusing to run.
    let with_head = device_reserve.total().saturating_add(shape.head_bytes);
    let head_on_disk = req.budgets.device.is_none()
        && with_head.saturating_add(max_slot) > device_budget
        && device_reserve.total().saturating_add(max_slot) <= device_budget;
    let fixed = if head_on_disk {
        device_reserve.total()
    } else {
        with_head
    };
    let device_avail = device_budget.saturating_sub(fixed);
    let tier_name = if req.budgets.device.is_some() {
        "device"
    } else {
        "RAM"
    };
    let all: Vec<usize> = (0..n).collect();
    // Layers are held coded only on the CPU, over a store that has a coded form.
    let ram_coded = req.budgets.device.is_none()
        && shape.stored_bytes.len() == n
        && req.ram_tier != RamTier::Raw;
    // The reserve and head must fit before any layer does (`device_avail` saturates).
    let placed = (fixed <= device_budget)
        .then(|| {
            if ram_coded && req.ram_tier == RamTier::Coded {
                split_all_streamed(&slot_sizes, device_avail, req.depth)
            } else {
                split(sizes, &slot_sizes, &all, device_avail, req.depth)
            }
        })
        .flatten();
    let Some((off_device, device_slots, device_slot_bytes)) = placed else {
        // On the CPU the head could have stayed on disk: what is missing is the rest.
        let (needed, head) = if req.budgets.device.is_none() {
            (
                device_reserve.total().saturating_add(max_slot),
                "the output head stays on disk".to_string(),
            )
        } else {
            (
                with_head.saturating_add(max_slot),
                format!("output head {}", shape.head_bytes),
            )
        };
        return Err(Error::BudgetTooSmall {
            tier: tier_name,
            budget: device_budget,
            needed,
            what: format!(
                "reserve {} (KV cache {}, activations {}, scratch {}, margin {}) + one slot of {}; {head}",
                device_reserve.total(),
                device_reserve.kv,
                device_reserve.activations,
                device_reserve.scratch,
                device_reserve.margin,
                max_slot
            ),
        });
    };
    let mut tiers = vec![Tier::Device; n];
    let (mut ram_reserve, mut staging_slots, mut staging_slot_bytes) = (Reserve::default(), 0, 0);
    match req.budgets.device {
        None => {
            for &i in &off_device {
                tiers[i] = Tier::Disk;
            }
            if ram_coded {
                // What the resident layers and the slots leave of the pool holds
                // streamed layers coded.
                let resident = sum_of(sizes, (0..n).filter(|i| tiers[*i] == Tier::Device));
                let room = device_avail
                    .saturating_sub(resident)
                    .saturating_sub(device_slot_bytes.saturating_mul(device_slots as u64));
                for i in held_coded(&off_device, &shape.stored_bytes, room) {
                    tiers[i] = Tier::Ram;
                }
            }
        }
        Some(_) => {
            let ram = req.budgets.ram;
            let host_kv = if shape.kv_on_device_only {
                0
            } else {
                device_reserve.kv
            };
            ram_reserve = Reserve::host_of_device(host_kv, ram);
            let ram_avail = ram.saturating_sub(ram_reserve.total());
            let max_staging = off_device
                .iter()
                .map(|&i| slot_bytes(sizes[i]))
                .max()
                .unwrap_or(0);
            let placed = (ram_reserve.total() <= ram)
                .then(|| split(sizes, sizes, &off_device, ram_avail, req.depth))
                .flatten();
            let Some((to_disk, s, sb)) = placed else {
                return Err(Error::BudgetTooSmall {
                    tier: "RAM",
                    budget: ram,
                    needed: ram_reserve.total().saturating_add(max_staging),
                    what: format!(
                        "KV cache {} + margin {} + one staging buffer of {}",
                        ram_reserve.kv, ram_reserve.margin, max_staging
                    ),
                });
            };
            for &i in &off_device {
                tiers[i] = Tier::Ram;
            }
            for &i in &to_disk {
                tiers[i] = Tier::Disk;
            }
            (staging_slots, staging_slot_bytes) = (s, sb);
        }
    }
    Ok(Plan {
        tiers,
        unified: req.budgets.device.is_none(),
        budgets: req.budgets,
        device_reserve,
        ram_reserve,
        head_bytes: shape.head_bytes,
        head_on_disk,
        device_slots,
        device_slot_bytes,
        staging_slots,
        staging_slot_bytes,
        requested_depth: req.depth,
        layer_bytes: sizes.clone(),
        computed_bytes: (0..n).map(|i| shape.computed_layer_bytes(i)).collect(),
        kv_bytes_per_token_layer: shape.kv_bytes_per_token_layer(),
        kv_windows: shape.kv_windows.clone(),
        embd_row_bytes: shape.embd_row_bytes,
        expert_bytes,
        expert_share: shape.expert_share.clamp(0.0, 1.0),
        stored_bytes: shape.stored_bytes.clone(),
        decode_bytes_per_s: shape.decode_bytes_per_s.max(0.0),
        decode_readers: shape.decode_readers.max(1),
        ram_coded,
    })
}

/// Bytes moved per generated token, by where they come from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BytesPerToken {
    /// Read by the compute from resident device memory (tier A and the head).
    pub device: u64,
    /// Uploaded from RAM to the device (tiers B and C; zero on the CPU backend).
    pub host_to_device: u64,
    /// Read from disk (tier C, plus one embedding row).
    pub disk: u64,
}

/// Speeds of the machine a plan runs on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Speeds {
    /// Bytes of weights the backend computes over per second in a decode step
    /// (matrix-vector products are bound by memory bandwidth).
    pub compute_bytes_per_s: f64,
    /// Host-to-device bandwidth (PCIe); ignored on the CPU backend.
    pub h2d_bytes_per_s: f64,
    /// Disk read bandwidth.
    pub disk_bytes_per_s: f64,
}

/// What limits a plan's speed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bottleneck {
    /// The backend's compute (memory bandwidth of matrix-vector products).
    Compute,
    /// Host-to-device uploads (PCIe).
    HostToDevice,
    /// Reads from disk.
    Disk,
}

impl Bottleneck {
    /// Name for tables.
    pub fn name(self) -> &'static str {
        match self {
            Bottleneck::Compute => "compute",
            Bottleneck::HostToDevice => "PCIe (host to device)",
            Bottleneck::Disk => "disk",
        }
    }
}

/// The predicted time of one generated token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Prediction {
    /// Seconds per token of the pipelined schedule (steady state).
    pub seconds_per_token: f64,
    /// Busy time of the compute per token.
    pub compute_s: f64,
    /// Busy time of the host-to-device link per token.
    pub h2d_s: f64,
    /// Busy time of the disk per token: of the reader threads, which read the
    /// streamed layers and decode those of a compressed store (`decode_s` of it).
    pub disk_s: f64,
    /// The part of `disk_s` the readers spend decoding (a compressed store).
    pub decode_s: f64,
    /// The busiest resource.
    pub bottleneck: Bottleneck,
}

impl Prediction {
    /// Tokens per second.
    pub fn tokens_per_s(&self) -> f64 {
        if self.seconds_per_token > 0.0 {
            1.0 / self.seconds_per_token
        } else {
            f64::INFINITY
        }
    }
}

impl Plan {
    /// Layers per tier: (device, ram, disk).
    pub fn counts(&self) -> (usize, usize, usize) {
        let c = |t| self.tiers.iter().filter(|&&x| x == t).count();
        (c(Tier::Device), c(Tier::Ram), c(Tier::Disk))
    }

    /// Bytes of the layers in `tier`, as that tier holds them: a coded RAM tier holds
    /// their stored bytes, the others their raw bytes (the disk tier: what it would
    /// take in memory).
    pub fn tier_bytes(&self, tier: Tier) -> u64 {
        (0..self.tiers.len())
            .filter(|&i| self.tiers[i] == tier)
            .fold(0u64, |a, i| a.saturating_add(self.held_bytes(i)))
    }

    /// Bytes layer `i` takes where its tier holds it.
    pub fn held_bytes(&self, i: usize) -> u64 {
        match self.stored_bytes.get(i) {
            Some(&stored) if self.ram_coded && self.tiers[i] == Tier::Ram => stored,
            _ => self.layer_bytes[i],
        }
    }

    /// Whether layer `i` passes through the reader threads on every use: read from
    /// disk, or held coded and decoded.
    fn through_readers(&self, i: usize) -> bool {
        self.tiers[i] == Tier::Disk || (self.ram_coded && self.tiers[i] == Tier::Ram)
    }

    /// Layers decoded per token (read from a pack on disk, or held coded).
    pub fn decodes_per_token(&self) -> usize {
        if self.stored_bytes.is_empty() {
            return 0;
        }
        (0..self.tiers.len())
            .filter(|&i| self.through_readers(i))
            .count()
    }

    /// Bytes this plan holds in device memory (the RAM pool when unified): resident
    /// layers, slots, head and reserve.
    pub fn device_used(&self) -> u64 {
        // On the CPU a coded RAM tier is in the same memory as the resident layers.
        let coded = if self.unified {
            self.tier_bytes(Tier::Ram)
        } else {
            0
        };
        self.tier_bytes(Tier::Device)
            .saturating_add(coded)
            .saturating_add(
                self.device_slot_bytes
                    .saturating_mul(self.device_slots as u64),
            )
            .saturating_add(self.resident_head_bytes())
            .saturating_add(self.device_reserve.total())
    }

    /// Bytes of the head held where the backend computes (zero when it is on disk).
    pub fn resident_head_bytes(&self) -> u64 {
        if self.head_on_disk {
            0
        } else {
            self.head_bytes
        }
    }

    /// Bytes this plan holds in RAM besides the device pool (zero when unified).
    pub fn ram_used(&self) -> u64 {
        if self.unified {
            return 0;
        }
        self.tier_bytes(Tier::Ram)
            .saturating_add(
                self.staging_slot_bytes
                    .saturating_mul(self.staging_slots as u64),
            )
            .saturating_add(self.ram_reserve.total())
    }

    /// Bytes moved per generated token.
    pub fn bytes_per_token(&self) -> BytesPerToken {
        let (a, b) = (self.tier_bytes(Tier::Device), self.tier_bytes(Tier::Ram));
        let c = (0..self.tiers.len())
            .filter(|&i| self.tiers[i] == Tier::Disk)
            .fold(0u64, |acc, i| {
                acc.saturating_add(self.prefetched_bytes(i))
                    .saturating_add(self.chosen_expert_bytes(i))
            });
        BytesPerToken {
            device: a.saturating_add(self.resident_head_bytes()),
            host_to_device: if self.unified { 0 } else { b.saturating_add(c) },
            disk: c
                .saturating_add(self.embd_row_bytes)
                .saturating_add(self.head_bytes - self.resident_head_bytes()),
        }
    }

    /// Bytes of streamed layer `i` read ahead of its use: all of it, or on the CPU all
    /// but its experts.
    fn prefetched_bytes(&self, i: usize) -> u64 {
        let stored = self
            .stored_bytes
            .get(i)
            .copied()
            .unwrap_or(self.layer_bytes[i]);
        stored.saturating_sub(self.expert_bytes.get(i).copied().unwrap_or(0))
    }

    /// Seconds the store beneath spends decoding streamed layer `i` (0 when nothing is
    /// decoded).
    fn decode_seconds(&self, i: usize) -> f64 {
        if self.decode_bytes_per_s > 0.0 && !self.stored_bytes.is_empty() {
            self.layer_bytes[i] as f64 / self.decode_bytes_per_s
        } else {
            0.0
        }
    }

    /// When the layers stream from a compressed store: seconds per token that decoding
    /// adds and that the smaller reads save, at `disk_bytes_per_s`. Compression pays
    /// when the second is larger (decoding overlaps nothing in the reader).
    pub fn compression_trade(&self, disk_bytes_per_s: f64) -> Option<(f64, f64)> {
        if self.stored_bytes.is_empty() || disk_bytes_per_s <= 0.0 {
            return None;
        }
        let disk: Vec<usize> = (0..self.tiers.len())
            .filter(|&i| self.tiers[i] == Tier::Disk)
            .collect();
        let decode: f64 = disk.iter().map(|&i| self.decode_seconds(i)).sum();
        let saved: u64 = disk
            .iter()
            .map(|&i| self.layer_bytes[i].saturating_sub(self.stored_bytes[i]))
            .sum();
        Some((decode, saved as f64 / disk_bytes_per_s))
    }

    /// Bytes of streamed layer `i`'s experts one token reads (no cache hits counted).
    fn chosen_expert_bytes(&self, i: usize) -> u64 {
        let e = self.expert_bytes.get(i).copied().unwrap_or(0);
        (e as f64 * self.expert_share).ceil() as u64
    }

    /// Predicted time per generated token with `kv_tokens` tokens in the cache, from
    /// a simulation of the pipeline this plan runs: the compute goes layer by layer,
    /// each streamed layer waits for its transfer, a transfer waits for its link and
    /// for a free slot (freed when the layer `depth` streamed layers earlier has
    /// computed), and prefetch runs on into the next token. Three tokens are
    /// simulated; the last is the steady state.
    pub fn predict(&self, speeds: &Speeds, kv_tokens: u64) -> Prediction {
        let n = self.tiers.len();
        let rate = |b: u64, r: f64| if r > 0.0 { b as f64 / r } else { 0.0 };
        // A windowed layer's attention reads at most its window.
        let kv = |l: usize| {
            let tokens = match self.kv_windows.get(l).copied().flatten() {
                Some(w) => kv_tokens.min(w),
                None => kv_tokens,
            };
            self.kv_bytes_per_token_layer.saturating_mul(tokens)
        };
        let compute: Vec<f64> = self
            .computed_bytes
            .iter()
            .enumerate()
            .map(|(l, &b)| rate(b.saturating_add(kv(l)), speeds.compute_bytes_per_s))
            .collect();
        let head = rate(self.head_bytes, speeds.compute_bytes_per_s);
        // A head on disk is paged in while the head computes: nothing overlaps it.
        let head_disk = rate(
            self.head_bytes - self.resident_head_bytes(),
            speeds.disk_bytes_per_s,
        );
        let streamed: Vec<usize> = (0..n).filter(|&i| self.tiers[i] != Tier::Device).collect();
        // A layer read from a compressed store is decoded by its reader piece by piece
        // between reads, while the other readers read: the link is busy for the read,
        // or for the readers' share of read and decode when decoding is the slower. A
        // layer held coded is only decoded, by the same readers.
        let readers = self.decode_readers.max(1) as f64;
        let disk_time = |i: usize| match self.tiers[i] {
            Tier::Disk => {
                let read = rate(self.prefetched_bytes(i), speeds.disk_bytes_per_s);
                read.max((read + self.decode_seconds(i)) / readers)
            }
            Tier::Ram if self.ram_coded => self.decode_seconds(i) / readers,
            _ => 0.0,
        };
        // The chosen experts are read when the router has run: the compute waits.
        let expert_time = |i: usize| {
            if self.tiers[i] == Tier::Disk {
                rate(self.chosen_expert_bytes(i), speeds.disk_bytes_per_s)
            } else {
                0.0
            }
        };
        let h2d_time = |i: usize| {
            if self.unified {
                0.0
            } else {
                rate(self.layer_bytes[i], speeds.h2d_bytes_per_s)
            }
        };
        const TOKENS: usize = 3;
        let depth = self.device_slots.max(1);
        let staging = self.staging_slots.max(1);
        // Per streamed access (in order over the tokens): when its transfer ends.
        let mut ready: Vec<f64> = Vec::new();
        // When the compute of each streamed access ended (frees its slot).
        let mut freed: Vec<f64> = Vec::new();
        // Disk accesses: when each one's upload ended (frees its staging buffer).
        let mut staged_free: Vec<f64> = Vec::new();
        let (mut disk_free, mut h2d_free, mut t) = (0.0f64, 0.0f64, 0.0f64);
        let mut token_end = Vec::new();
        // Transfers are issued in access order; compute as soon as the data is there.
        // Because a transfer depends only on earlier computes (slot frees), issue each
        // lazily right before the compute that needs it, computing its start from the
        // state so far: that is exact for a FIFO link.
        for _ in 0..TOKENS {
            #[allow(clippy::needless_range_loop)] // `i` indexes tiers, sizes and compute
            for i in 0..n {
                if self.tiers[i] != Tier::Device {
                    let j = ready.len();
                    let slot_free = if j >= depth { freed[j - depth] } else { 0.0 };
                    let mut data_at = 0.0f64;
                    if self.through_readers(i) {
                        let k = staged_free.len();
                        let buf_free = if self.unified {
                            slot_free
                        } else if k >= staging {
                            staged_free[k - staging]
                        } else {
                            0.0
                        };
                        let start = disk_free.max(buf_free);
                        disk_free = start + disk_time(i);
                        data_at = disk_free;
                    }
                    let end = if self.unified {
                        data_at
                    } else {
                        let start = h2d_free.max(slot_free).max(data_at);
                        h2d_free = start + h2d_time(i);
                        h2d_free
                    };
                    if self.through_readers(i) {
                        staged_free.push(end);
                    }
                    ready.push(end);
                    t = t.max(end);
                }
                let experts = expert_time(i);
                if experts > 0.0 {
                    t = t.max(disk_free) + experts;
                    disk_free = t;
                }
                t += compute[i];
                if self.tiers[i] != Tier::Device {
                    freed.push(t);
                }
            }
            t = t.max(disk_free) + head_disk;
            disk_free = t;
            t += head;
            token_end.push(t);
        }
        let seconds_per_token = token_end[TOKENS - 1] - token_end[TOKENS - 2];
        // Folds from +0.0 (a float `sum` of nothing is -0.0).
        let compute_s = compute.iter().fold(0.0, |a, b| a + b) + head;
        let disk_s = streamed
            .iter()
            .fold(0.0, |a, &i| a + disk_time(i) + expert_time(i))
            + head_disk;
        let decode_s = streamed
            .iter()
            .filter(|&&i| self.through_readers(i))
            .fold(0.0, |a, &i| a + self.decode_seconds(i));
        let h2d_s = streamed.iter().fold(0.0, |a, &i| a + h2d_time(i));
        let bottleneck = if disk_s >= compute_s && disk_s >= h2d_s {
            Bottleneck::Disk
        } else if h2d_s >= compute_s {
            Bottleneck::HostToDevice
        } else {
            Bottleneck::Compute
        };
        Prediction {
            seconds_per_token,
            compute_s,
            h2d_s,
            disk_s,
            decode_s,
            bottleneck,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_is_even_and_distinct() {
        assert_eq!(spread(10, 2), vec![2, 7]);
        assert_eq!(spread(4, 4), vec![0, 1, 2, 3]);
        assert_eq!(spread(5, 0), Vec::<usize>::new());
    }

    /// The CPU plan of `shape` in 1 GiB of RAM, 256 tokens of context.
    fn plan_in_a_gib(shape: ModelShape) -> Plan {
        plan(&PlanRequest {
            shape,
            budgets: Budgets {
                device: None,
                ram: 1 << 30,
            },
            ctx: 256,
            batch: 8,
            depth: 2,
            ram_tier: RamTier::Raw,
        })
        .unwrap()
    }

    #[test]
    fn all_resident_when_it_fits() {
        let p = plan_in_a_gib(ModelShape::from_dims(4, 64, 4, 2, 128, 257, 8.5, 8.5));
        assert_eq!(p.counts(), (4, 0, 0));
        assert_eq!(p.device_slots, 0);
    }

    /// A mixture of experts computes the experts its router chooses, not all of them:
    /// the predicted compute of a resident model counts the chosen share.
    #[test]
    fn a_mixture_of_experts_computes_the_chosen_experts() {
        let mut shape = ModelShape::from_dims(4, 64, 4, 2, 128, 257, 8.5, 8.5);
        let dense = shape.total_layer_bytes();
        let per_layer = shape.layer_bytes[0];
        shape.expert_bytes = vec![per_layer / 2; 4];
        shape.expert_share = 0.25;
        assert_eq!(
            shape.computed_layer_bytes(0),
            per_layer - (per_layer / 2) * 3 / 4
        );
        let computed = shape.total_computed_bytes();
        assert!(computed < dense);
        // One token holds its share of a layer's experts; a prompt chunk nearly all.
        let experts = per_layer / 2;
        assert_eq!(
            shape.expert_working_set(1),
            (experts as f64 * 0.25).ceil() as u64
        );
        assert_eq!(shape.expert_working_set(512), experts);
        let chunk = Reserve::for_context(&shape, 256, 512, 1 << 30);
        let dense_chunk = Reserve::for_context(
            &ModelShape::from_dims(4, 64, 4, 2, 128, 257, 8.5, 8.5),
            256,
            512,
            1 << 30,
        );
        assert_eq!(chunk.scratch, dense_chunk.scratch + experts);
        let p = plan_in_a_gib(shape.clone());
        let speeds = Speeds {
            compute_bytes_per_s: 1e6,
            h2d_bytes_per_s: 1e9,
            disk_bytes_per_s: 1e9,
        };
        let pr = p.predict(&speeds, 0);
        let want = (computed + shape.head_bytes) as f64 / 1e6;
        assert!(
            (pr.compute_s - want).abs() < 1e-9,
            "{} vs {want}",
            pr.compute_s
        );
    }
}
