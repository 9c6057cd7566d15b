//! The device executor of a [`Graph`]: every op recorded into one command encoder, with
//! activations in device buffers (one per tensor of the graph), weights uploaded once or
//! streamed per use, and the device mirror of the session's KV cache. One submission
//! (one per turn of the stream-slot ring when layers stream) and one read-back per pass,
//! plus one of each per host sync point of the MLP lever.
//!
//! Nothing here knows a model: the ops say what to compute, weights are resolved by the
//! role the op names in the current layer's table.

use std::sync::Arc;
use std::time::Instant;

use super::kv::KvMirror;
use super::ops::{record_kv_write, DeviceKvLayout, KvBinding};
use super::record::{Params, Recorder};
use super::{rope_table, DeviceKv, DeviceWeight, WgpuBackend, ARGMAX};
use crate::backend::{DeviceExecutor, DeviceForwardInput, LayerSource, PassReport, Rope};
use crate::error::{Error, Result};
use crate::ffn::FeedForward;
use crate::graph::{self, Graph, Op, PassSequence, TensorId, WeightRef};
use crate::kv::{KvCache, KvElement};
use crate::weights::LayerWeights;

/// The layer an op sequence is inside: its weights as the store lent them, and their
/// device copies in table order.
struct CurrentLayer {
    host: Arc<LayerWeights>,
    /// `None` for a matrix no op of the pass multiplies by.
    device: Vec<Option<Arc<DeviceWeight>>>,
}

/// The layer matrices the ops of `graph` multiply by on the device, by role: what a
/// layer's table must have on the device for the pass. A lever's MLP (a host sync point)
/// names none, so its matrices stay wherever the store keeps them.
fn device_roles(graph: &Graph) -> Vec<&'static str> {
    let mut roles = Vec::new();
    let mut add = |r: &WeightRef| {
        if let WeightRef::Layer(role) = r {
            if !roles.contains(role) {
                roles.push(*role);
            }
        }
    };
    for op in graph.ops() {
        match op {
            Op::Matmul { jobs, .. } => jobs.iter().for_each(|(r, _)| add(r)),
            Op::Moe { weights, .. } => {
                for r in [&weights.router, &weights.gate, &weights.up, &weights.down] {
                    add(r);
                }
                if let Some(s) = &weights.shared {
                    for r in [&s.gate_inp, &s.gate, &s.up, &s.down] {
                        add(r);
                    }
                }
            }
            Op::Embed { table, .. } => add(table),
            _ => {}
        }
    }
    roles
}

impl WgpuBackend {
    /// The device weight `r` names: from the current layer's table, or a global one
    /// (uploaded once and cached).
    fn device_matrix(
        &self,
        r: WeightRef,
        input: &DeviceForwardInput<'_>,
        layer: Option<&CurrentLayer>,
    ) -> Result<Arc<DeviceWeight>> {
        match (r, layer) {
            (WeightRef::Layer(role), Some(cur)) => {
                match cur.host.matrices.iter().position(|(name, _)| name == role) {
                    Some(i) => cur.device[i].clone().ok_or_else(|| Error::InvalidArgument {
                        what: format!("{role} of layer {} is not on the device", cur.host.index),
                    }),
                    None => cur
                        .host
                        .matrix(role)
                        .map(|_| unreachable!("not in the table")),
                }
            }
            _ => self.weight(r.matrix(input.globals, layer.map(|c| c.host.as_ref()))?),
        }
    }
}

impl WgpuBackend {
    /// A host sync point: submits what `rec` holds and reads tensor `t` back.
    fn read_tensor(
        &self,
        rec: &mut Recorder<'_>,
        graph: &Graph,
        t: TensorId,
        buffer: &wgpu::Buffer,
    ) -> Result<Vec<f32>> {
        let bytes = rec.read_now(buffer, 0, (graph.desc(t).len() * 4) as u64)?;
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }
}

impl WgpuBackend {
    /// The MLP lever's host sync point for layer `l`: reads `x` back (its buffer of
    /// `bufs`, one per tensor), runs `ffn` on the host (its matrix products through this
    /// backend's ops) and uploads its result to `out`.
    #[allow(clippy::too_many_arguments)]
    fn host_ffn(
        &self,
        rec: &mut Recorder<'_>,
        graph: &Graph,
        bufs: &[wgpu::Buffer],
        l: usize,
        host_layer: Option<&LayerWeights>,
        ffn: &mut dyn FeedForward,
        x: TensorId,
        out: TensorId,
    ) -> Result<()> {
        let host = self.read_tensor(rec, graph, x, &bufs[x.index()])?;
        let w = host_layer.ok_or_else(|| Error::InvalidArgument {
            what: format!("FeedForward of layer {l} outside BeginLayer/EndLayer"),
        })?;
        let mut result = vec![0f32; graph.desc(out).len()];
        ffn.forward(self, w, &host, graph.n_tokens(), &mut result)?;
        // Lands before the commands recorded next (read_now submitted the rest).
        self.ctx
            .queue()
            .write_buffer(&bufs[out.index()], 0, bytemuck::cast_slice(&result));
        Ok(())
    }
}

impl DeviceExecutor for WgpuBackend {
    fn forward(
        &self,
        graph: &Graph,
        input: &DeviceForwardInput<'_>,
        layers: &mut LayerSource<'_>,
        sequences: &mut [PassSequence<'_>],
        ffn: &mut dyn FeedForward,
        out: &mut Vec<f32>,
    ) -> Result<Option<u32>> {
        let start = Instant::now();
        // Neuron records a lever's host sync points upload count as this pass's uploads.
        let neurons_before = self.neuron_bytes_uploaded();
        let (ids, positions) = (input.ids, input.positions);
        let n = graph.n_tokens();
        if ids.len() != n || positions.len() != n {
            return Err(Error::ShapeMismatch {
                what: "token ids and positions of a device pass".into(),
                expected: n,
                got: ids.len().min(positions.len()),
            });
        }
        let rows: usize = sequences.iter().map(|s| s.rows).sum();
        if sequences.is_empty() || rows != n {
            return Err(Error::ShapeMismatch {
                what: "rows of the sequences of a device pass".into(),
                expected: n,
                got: rows,
            });
        }
        if let Some(op) = graph
            .ops()
            .iter()
            .find(|op| matches!(op, Op::KvPolicy { .. }))
        {
            return Err(Error::InvalidArgument {
                what: format!("a device pass cannot run the host sync point {op:?}"),
            });
        }
        let shape = sequences[0].kv.shape();
        let (n_layers, kvd) = (shape.n_layers, shape.kv_dim());
        if let Some(other) = sequences.iter().find(|s| s.kv.shape() != shape) {
            return Err(Error::InvalidArgument {
                what: format!(
                    "the caches of one device pass differ in shape ({shape:?} and {:?})",
                    other.kv.shape()
                ),
            });
        }
        // Held for the whole pass: passes of sessions sharing this backend take turns
        // (they share the arena's buffers, and the host caches' mirrors).
        let mut mirrors = self.kv.lock().unwrap_or_else(|p| p.into_inner());
        let cached: Vec<usize> = sequences.iter().map(|s| s.kv.len()).collect();
        let mut rec = self.pass_recorder();
        // Each sequence's binding: its device cache's slots (taken now), or its host
        // cache's device mirror (synced now; the host cache changes after the pass).
        let mut bound: Vec<SequenceKv> = Vec::with_capacity(sequences.len());
        let mut mirror_owners = Vec::new();
        let mut first = 0;
        let rewind_taken = |sequences: &mut [PassSequence<'_>], bound: &[SequenceKv]| {
            for (seq, b) in sequences.iter_mut().zip(bound) {
                if b.mirror.is_none() {
                    seq.kv.rewind(b.cached);
                }
            }
        };
        for (i, seq) in sequences.iter_mut().enumerate() {
            let seq_positions = &positions[first..first + seq.rows];
            let on_device = seq
                .kv
                .device_rows()
                .and_then(|rows| rows.downcast_mut::<DeviceKv>())
                .filter(|d| d.is_on(&self.ctx));
            let result = match on_device {
                Some(dkv) => self
                    .bind_device_kv(&mut rec, dkv, seq_positions)
                    .map(|kv| (kv, None)),
                None => self
                    .sync_kv(&mut mirrors, &*seq.kv, n_layers, kvd, &mirror_owners)
                    .and_then(|owner| {
                        mirror_owners.push(owner);
                        let at = mirror_index(&mirrors, owner);
                        let kv =
                            self.bind_mirror(&mut rec, &mirrors[at], cached[i], seq_positions)?;
                        Ok((kv, Some(owner)))
                    }),
            };
            match result {
                Ok((kv, mirror)) => bound.push(SequenceKv {
                    kv,
                    rows: first..first + seq.rows,
                    cached: cached[i],
                    mirror,
                }),
                Err(e) => {
                    if on_device_now(seq) {
                        // Slots some layers took before the failure go back.
                        seq.kv.rewind(cached[i]);
                    }
                    rewind_taken(sequences, &bound);
                    return Err(e);
                }
            }
            first += seq.rows;
        }
        let result = self.record_graph(graph, input, layers, ffn, rec, &bound, out);
        let (bytes, mut report, id) = match result {
            Ok(r) => r,
            Err(e) => {
                rewind_taken(sequences, &bound);
                return Err(e);
            }
        };
        // The device mirrors now hold the new tokens; the host caches get them too, from
        // the keys and values of the whole pass, read back with the logits.
        let new_kv_bytes = n * kvd * 4;
        let mut device_bytes = 0;
        for (seq, b) in sequences.iter_mut().zip(&bound) {
            let Some(owner) = b.mirror else {
                device_bytes += seq.kv.held_bytes().device;
                continue;
            };
            let at = mirror_index(&mirrors, owner);
            let m = &mut mirrors[at];
            m.host_positions
                .extend_from_slice(&positions[b.rows.clone()]);
            let (lo, hi) = (b.rows.start * kvd * 4, b.rows.end * kvd * 4);
            for l in 0..n_layers {
                let kb = &bytes[2 * l * new_kv_bytes..(2 * l + 1) * new_kv_bytes];
                let vb = &bytes[(2 * l + 1) * new_kv_bytes..(2 * l + 2) * new_kv_bytes];
                let keys: Vec<f32> = bytemuck::pod_collect_to_vec(&kb[lo..hi]);
                let values: Vec<f32> = bytemuck::pod_collect_to_vec(&vb[lo..hi]);
                if let Err(e) = seq.kv.append(l, &positions[b.rows.clone()], &keys, &values) {
                    // Keep the mirror honest: it must not claim tokens the host refused.
                    m.host_positions.clear();
                    return Err(e);
                }
            }
            device_bytes += m
                .keys
                .iter()
                .chain(&m.values)
                .map(|b| b.size())
                .sum::<u64>()
                + m.positions.size();
        }
        report.kv_device_bytes = device_bytes;
        report.bytes_uploaded += self.neuron_bytes_uploaded() - neurons_before;
        report.wall = start.elapsed();
        report.tokens = n;
        *self.report.lock().unwrap_or_else(|p| p.into_inner()) = report;
        Ok(id)
    }

    fn new_kv_cache(
        &self,
        shape: crate::kv::KvShape,
        capacity: usize,
        element: crate::kv::KvElement,
    ) -> Result<Option<Box<dyn KvCache>>> {
        let cache = DeviceKv::new(self.ctx.clone(), shape, capacity, element)?;
        Ok(Some(Box::new(cache)))
    }

    fn new_windowed_kv_cache(
        &self,
        shape: crate::kv::KvShape,
        capacity: usize,
        element: crate::kv::KvElement,
        windows: &[Option<usize>],
        chunk: usize,
    ) -> Result<Option<Box<dyn KvCache>>> {
        let cache = DeviceKv::windowed(self.ctx.clone(), shape, capacity, element, windows, chunk)?;
        Ok(Some(Box::new(cache)))
    }
}

/// Whether `seq`'s cache is a device cache (whose slots a failed binding may have
/// taken).
fn on_device_now(seq: &mut PassSequence<'_>) -> bool {
    seq.kv
        .device_rows()
        .is_some_and(|rows| rows.downcast_mut::<DeviceKv>().is_some())
}

/// Where the mirror of the host cache `owner` sits in `mirrors` now.
fn mirror_index(mirrors: &[KvMirror], owner: usize) -> usize {
    mirrors
        .iter()
        .position(|m| m.owner == owner)
        .expect("a mirror synced in this pass is kept for it")
}

/// One sequence of a device pass: its rows of the pass and where its keys and values
/// go.
struct SequenceKv {
    kv: PassKv,
    rows: std::ops::Range<usize>,
    /// Tokens its cache held before the pass.
    cached: usize,
    /// The host cache this sequence's mirror mirrors (its owner key), when its cache is
    /// not a device cache.
    mirror: Option<usize>,
}

/// Where a pass's keys and values go and are read from, layer by layer.
struct PassKv {
    elem: KvElement,
    layers: Vec<LayerKv>,
    /// Each layer's new rows go to the slots of `slot_lists[layers[l].slots]`.
    slot_lists: Vec<wgpu::Buffer>,
    /// Whether the new keys and values are read back for a host cache.
    read_back: bool,
}

struct LayerKv {
    keys: wgpu::Buffer,
    values: wgpu::Buffer,
    positions: wgpu::Buffer,
    /// Slots attention scans, the new tokens' included.
    n_slots: usize,
    slots: usize,
    /// Rows the layer's buffers hold (a sliding-window layer of a `DeviceKv` holds
    /// fewer than the context).
    capacity: usize,
}

impl WgpuBackend {
    /// Binds a [`DeviceKv`]: every layer takes slots for the new tokens (their
    /// positions written), and the pass writes rows there and reads none back.
    fn bind_device_kv(
        &self,
        rec: &mut Recorder<'_>,
        dkv: &mut DeviceKv,
        positions: &[u32],
    ) -> Result<PassKv> {
        let n_layers = dkv.shape().n_layers;
        let mut lists: Vec<Vec<u32>> = Vec::new();
        let mut layers = Vec::with_capacity(n_layers);
        for l in 0..n_layers {
            let slots = dkv.reserve(l, positions)?;
            let at = match lists.iter().position(|s| *s == slots) {
                Some(at) => at,
                None => {
                    lists.push(slots);
                    lists.len() - 1
                }
            };
            let b = dkv.layer(l).expect("a layer of the cache");
            layers.push(LayerKv {
                keys: b.keys.clone(),
                values: b.values.clone(),
                positions: b.positions.clone(),
                n_slots: b.n_slots,
                slots: at,
                capacity: b.rows,
            });
        }
        let slot_lists = lists
            .iter()
            .map(|s| rec.upload("kv slots", bytemuck::cast_slice(s)))
            .collect::<Result<Vec<_>>>()?;
        Ok(PassKv {
            elem: dkv.elem(),
            layers,
            slot_lists,
            read_back: false,
        })
    }

    /// Binds the device mirror of a host cache: the new tokens take the rows after the
    /// `cached` ones, and their keys and values are read back for the host cache.
    fn bind_mirror(
        &self,
        rec: &mut Recorder<'_>,
        mirror: &KvMirror,
        cached: usize,
        positions: &[u32],
    ) -> Result<PassKv> {
        let n = positions.len();
        if cached + n > mirror.capacity {
            return Err(Error::ContextFull {
                needed: cached + n,
                capacity: mirror.capacity,
            });
        }
        self.ctx.queue().write_buffer(
            mirror.positions.raw(),
            (cached * 4) as u64,
            bytemuck::cast_slice(positions),
        );
        let new_slots: Vec<u32> = (cached as u32..(cached + n) as u32).collect();
        let slots = rec.upload("kv slots", bytemuck::cast_slice(&new_slots))?;
        let layers = mirror
            .keys
            .iter()
            .zip(&mirror.values)
            .map(|(k, v)| LayerKv {
                keys: k.raw().clone(),
                values: v.raw().clone(),
                positions: mirror.positions.raw().clone(),
                n_slots: cached + n,
                slots: 0,
                capacity: mirror.capacity,
            })
            .collect();
        Ok(PassKv {
            elem: mirror.elem,
            layers,
            slot_lists: vec![slots],
            read_back: true,
        })
    }

    /// Records and runs the ops of `graph` over `kv`: returns the bytes read back (the
    /// new keys and values first when `kv.read_back`, then the logits or greedy id),
    /// the pass's report and the greedy id.
    #[allow(clippy::too_many_arguments)]
    fn record_graph(
        &self,
        graph: &Graph,
        input: &DeviceForwardInput<'_>,
        layers: &mut LayerSource<'_>,
        ffn: &mut dyn FeedForward,
        mut rec: Recorder<'_>,
        seqs: &[SequenceKv],
        out: &mut Vec<f32>,
    ) -> Result<(Vec<u8>, PassReport, Option<u32>)> {
        let (ids, positions) = (input.ids, input.positions);
        let n = graph.n_tokens();
        let n_layers = seqs[0].kv.layers.len();
        let idb = rec.upload("token ids", bytemuck::cast_slice(ids))?;
        let qpos = rec.upload("positions", bytemuck::cast_slice(positions))?;
        let bufs = graph
            .tensors()
            .iter()
            .map(|t| rec.buffer(t.name, (t.len().max(1) * 4) as u64))
            .collect::<Result<Vec<wgpu::Buffer>>>()?;
        let buf = |t: TensorId| &bufs[t.index()];
        let kvd = graph
            .ops()
            .iter()
            .find_map(|op| match op {
                Op::KvWrite { k, .. } => Some(graph.desc(*k).len() / n.max(1)),
                _ => None,
            })
            .unwrap_or(0);
        // The new keys and values of every layer (all the pass's rows), read back with
        // the logits when a sequence has a host cache.
        let new_kv_bytes = n * kvd * 4;
        let read_back = seqs.iter().any(|s| s.kv.read_back);
        let kv_total = if read_back {
            (2 * n_layers * new_kv_bytes) as u64
        } else {
            0
        };
        let new_kv = rec.buffer("new kv", kv_total.max(4))?;
        // One cos/sin table per distinct RoPE of the pass.
        let mut rope_tables: Vec<(Rope, usize, wgpu::Buffer)> = Vec::new();

        let used = device_roles(graph);
        let mut layer: Option<CurrentLayer> = None;
        // Stream slots written since the last submission.
        let mut slots_in_use = Vec::new();
        for op in graph.ops() {
            let host_layer = layer.as_ref().map(|c| c.host.as_ref());
            match op {
                Op::Embed { table, out } => {
                    let w = table.matrix(input.globals, host_layer)?;
                    if let Some(&id) = ids.iter().find(|&&id| id as usize >= w.rows()) {
                        return Err(Error::TokenId {
                            id,
                            vocab: w.rows(),
                        });
                    }
                    let embd = self.weight(w)?;
                    self.record_embed(&mut rec, &embd, &idb, n, buf(*out));
                }
                Op::BeginLayer { layer: l } => {
                    // The store gets a streamed layer's slot back before the next is asked.
                    drop(layer.take());
                    let host = layers(*l)?;
                    let device = self.layer_weights(&mut rec, &host, &used, &mut slots_in_use)?;
                    layer = Some(CurrentLayer { host, device });
                }
                Op::EndLayer => layer = None,
                Op::RmsNorm { x, scale, eps, out } => {
                    let v = self.vector(scale.vector(input.globals, host_layer)?)?;
                    let d = graph.desc(*x);
                    self.record_rms_norm(
                        &mut rec,
                        buf(*x),
                        0,
                        d.rows,
                        v.raw(),
                        d.width,
                        *eps,
                        buf(*out),
                    );
                }
                Op::HeadRmsNorm {
                    x,
                    head_dim,
                    scale,
                    eps,
                    out,
                } => {
                    let host = scale.vector(input.globals, host_layer)?;
                    graph::check_head_norm(graph, *x, *head_dim, host.len())?;
                    let v = self.vector(host)?;
                    // The rms_norm kernel normalizes rows of any length: a head is a row.
                    let d = graph.desc(*x);
                    self.record_rms_norm(
                        &mut rec,
                        buf(*x),
                        0,
                        d.len() / head_dim,
                        v.raw(),
                        *head_dim,
                        *eps,
                        buf(*out),
                    );
                }
                Op::Matmul { x, jobs } => {
                    let d = graph.desc(*x);
                    let weights = jobs
                        .iter()
                        .map(|(w, _)| self.device_matrix(*w, input, layer.as_ref()))
                        .collect::<Result<Vec<_>>>()?;
                    let batch: Vec<(&DeviceWeight, &wgpu::Buffer)> = weights
                        .iter()
                        .zip(jobs)
                        .map(|(w, (_, t))| (w.as_ref(), buf(*t)))
                        .collect();
                    self.record_matmul(&mut rec, buf(*x), d.rows, d.width, &batch)?;
                }
                Op::AddBias { x, bias } => {
                    if let Some(b) = bias.find_vector(input.globals, host_layer)? {
                        let bb = self.vector(b)?;
                        let len = graph.desc(*x).len();
                        self.record_elementwise(
                            &mut rec,
                            "add_bias",
                            &[buf(*x), bb.raw()],
                            len,
                            b.len(),
                        );
                    }
                }
                Op::Rope {
                    x,
                    n_heads,
                    head_dim,
                    rope,
                } => {
                    let i = match rope_tables
                        .iter()
                        .position(|(r, hd, _)| r == rope && hd == head_dim)
                    {
                        Some(i) => i,
                        None => {
                            let table = rope_table(positions, *head_dim, rope);
                            let b = rec.upload("rope table", bytemuck::cast_slice(&table))?;
                            rope_tables.push((rope.clone(), *head_dim, b));
                            rope_tables.len() - 1
                        }
                    };
                    let table = &rope_tables[i].2;
                    self.record_rope(&mut rec, buf(*x), table, n, *n_heads, *head_dim, rope);
                }
                Op::KvWrite { layer: l, k, v } => {
                    let l = *l;
                    if graph.desc(*k).len() != n * kvd || graph.desc(*v).len() != n * kvd {
                        return Err(Error::KvShape {
                            expected: n * kvd,
                            keys: graph.desc(*k).len(),
                            values: graph.desc(*v).len(),
                        });
                    }
                    for seq in seqs {
                        let kv = &seq.kv;
                        let lk = kv
                            .layers
                            .get(l)
                            .ok_or(Error::LayerIndex { index: l, n_layers })?;
                        // Rounded into the cache's type exactly as a host cache rounds it.
                        for (src, dst) in [(k, &lk.keys), (v, &lk.values)] {
                            record_kv_write(
                                &mut rec,
                                kv.elem,
                                buf(*src),
                                seq.rows.start,
                                seq.rows.len(),
                                kvd,
                                &kv.slot_lists[lk.slots],
                                dst,
                                lk.capacity,
                            )?;
                        }
                    }
                    if read_back {
                        let len = new_kv_bytes as u64;
                        rec.copy(buf(*k), 0, &new_kv, (2 * l) as u64 * len, len);
                        rec.copy(buf(*v), 0, &new_kv, (2 * l + 1) as u64 * len, len);
                    }
                }
                Op::Attention {
                    layer: l,
                    q,
                    shape,
                    out,
                } => {
                    // Each sequence's rows over its own cache.
                    for seq in seqs {
                        let kv = &seq.kv;
                        let lk = kv.layers.get(*l).ok_or(Error::LayerIndex {
                            index: *l,
                            n_layers,
                        })?;
                        let binding = |buffer| KvBinding {
                            buffer,
                            elem: kv.elem,
                            scale_word: kv.elem.scale_word(lk.capacity * kvd),
                        };
                        self.record_attention_stored(
                            &mut rec,
                            buf(*q),
                            binding(&lk.keys),
                            binding(&lk.values),
                            &lk.positions,
                            &qpos,
                            seq.rows.clone(),
                            lk.n_slots,
                            shape,
                            buf(*out),
                        )?;
                    }
                }
                Op::Add { x, y } => {
                    let len = graph.desc(*x).len();
                    self.record_elementwise(&mut rec, "add", &[buf(*x), buf(*y)], len, 1);
                }
                Op::Swiglu { gate, up, out } => {
                    let len = graph.desc(*out).len();
                    self.record_elementwise(
                        &mut rec,
                        "swiglu",
                        &[buf(*out), buf(*gate), buf(*up)],
                        len,
                        1,
                    );
                }
                Op::Geglu { gate, up, out } => {
                    let len = graph.desc(*out).len();
                    self.record_elementwise(
                        &mut rec,
                        "geglu",
                        &[buf(*out), buf(*gate), buf(*up)],
                        len,
                        1,
                    );
                }
                Op::Scale { x, factor } => {
                    let len = graph.desc(*x).len();
                    self.record_elementwise_by(&mut rec, "scale", &[buf(*x)], len, 1, *factor);
                }
                Op::Rows { x, first, out } => {
                    let width = graph.desc(*x).width;
                    let len = graph.desc(*out).len();
                    rec.copy(
                        buf(*x),
                        (first * width * 4) as u64,
                        buf(*out),
                        0,
                        (len * 4) as u64,
                    );
                }
                Op::Gather { x, rows, out } => {
                    // One copy per row: the head's rows of a batched pass, a handful.
                    let row_bytes = (graph.desc(*x).width * 4) as u64;
                    for (i, &row) in rows.iter().enumerate() {
                        rec.copy(
                            buf(*x),
                            row as u64 * row_bytes,
                            buf(*out),
                            i as u64 * row_bytes,
                            row_bytes,
                        );
                    }
                }
                Op::FfnPrepare { layer: l, x } => {
                    let host = self.read_tensor(&mut rec, graph, *x, buf(*x))?;
                    ffn.prepare(*l, &host, n)?;
                }
                Op::Moe {
                    layer: l,
                    x,
                    out,
                    weights,
                    spec,
                } => {
                    let cur = layer.as_ref().ok_or_else(|| Error::InvalidArgument {
                        what: format!("the experts of layer {l} outside BeginLayer/EndLayer"),
                    })?;
                    let matrix = |r| self.device_matrix(r, input, Some(cur));
                    match self.moe_device(weights, input.globals, &cur.host, matrix)? {
                        Some(experts) => {
                            let d = graph.desc(*x);
                            self.record_moe(
                                &mut rec,
                                buf(*x),
                                d.rows,
                                d.width,
                                &experts,
                                spec,
                                buf(*out),
                            )?;
                        }
                        // Experts fetched on demand: the MLP runs as a lever's does.
                        None => {
                            self.host_ffn(&mut rec, graph, &bufs, *l, host_layer, ffn, *x, *out)?
                        }
                    }
                }
                Op::FeedForward { layer: l, x, out } => {
                    self.host_ffn(&mut rec, graph, &bufs, *l, host_layer, ffn, *x, *out)?;
                }
                Op::KvPolicy { .. } => unreachable!("refused above"),
            }
        }
        drop(layer);
        let best = rec.buffer("argmax", 4)?;
        let mut sources = Vec::new();
        if kv_total > 0 {
            sources.push((&new_kv, 0, kv_total));
        }
        if let Some(logits) = graph.logits() {
            let d = graph.desc(logits);
            if graph.greedy() {
                let vocab = d.width;
                let last = ((d.rows - 1) * vocab * 4) as u64;
                let row = if last == 0 {
                    buf(logits).clone()
                } else {
                    let row = rec.buffer("last logits", (vocab * 4) as u64)?;
                    rec.copy(buf(logits), last, &row, 0, (vocab * 4) as u64);
                    row
                };
                rec.dispatch(
                    &ARGMAX,
                    "argmax",
                    &[],
                    &[&row, &best],
                    Params::new([vocab as u32, 0, 0, 0], [0; 4], [0.0; 4]),
                    [1, 1, 1],
                    "argmax",
                    (vocab * 4) as u64,
                    4,
                    0,
                );
                sources.push((&best, 0, 4));
            } else {
                sources.push((buf(logits), 0, (d.len() * 4) as u64));
            }
        }
        let (bytes, report) = rec.finish(&sources)?;
        let rest = &bytes[kv_total as usize..];
        out.clear();
        let id = match graph.logits() {
            Some(_) if graph.greedy() => {
                Some(u32::from_le_bytes(rest[..4].try_into().expect("4 bytes")))
            }
            Some(_) => {
                out.extend_from_slice(&bytemuck::pod_collect_to_vec::<u8, f32>(rest));
                None
            }
            None => None,
        };
        Ok((bytes, report, id))
    }
}
