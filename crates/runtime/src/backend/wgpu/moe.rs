//! The mixture-of-experts MLP inside a device pass ([`crate::graph::Op::Moe`]): the
//! router as a plain matrix product, routing on the device (`moe_route.wgsl`: softmax,
//! top-k, renormalization and scale per token row, into an id buffer and a weight
//! buffer), the chosen experts' gate and up rows read through those ids
//! (`matmul_rows_id`), SwiGLU, their down rows likewise, and the weighted sum
//! in the order of the choice plus qwen2moe's shared expert (`moe_combine.wgsl`).
//! Nothing is read back: the whole MLP is commands of the pass's one submission.
//!
//! The stacked tensors are on the device whole, as the layer's other matrices: cached
//! by id when resident, or uploaded into the layer's stream slot when the store streams
//! the layer (every expert's bytes, since which ones a token picks is known only on
//! the device). A layer whose experts are not in its table (a store fetching chosen
//! experts on demand, on the CPU) is served by the pass's host sync path instead.

use super::ops::ExpertRows;
use super::weights::WeightChunk;
use super::*;
use crate::graph::{MoeWeights, WeightRef};
use crate::weights::{GlobalWeights, LayerWeights};
use ballast_core::config::MoeSpec;

// SAFETY: checked as `Shader::trusted` asks (`super`'s "Shaders").
pub(crate) const MOE_ROUTE: Shader = unsafe {
    Shader::trusted(
        "ballast.moe_route",
        concat!(include_str!("params.wgsl"), include_str!("moe_route.wgsl")),
    )
};
// SAFETY: checked as `Shader::trusted` asks (`super`'s "Shaders").
pub(crate) const MOE_COMBINE: Shader = unsafe {
    Shader::trusted(
        "ballast.moe_combine",
        concat!(
            include_str!("params.wgsl"),
            include_str!("moe_combine.wgsl")
        ),
    )
};

/// The device tensors of one layer's mixture of experts.
pub(super) struct MoeDevice {
    router: Arc<DeviceWeight>,
    /// The stacked gate, up and down matrices.
    gate: Arc<DeviceWeight>,
    up: Arc<DeviceWeight>,
    down: Arc<DeviceWeight>,
    shared: Option<SharedDevice>,
}

/// qwen2moe's shared expert on the device.
struct SharedDevice {
    /// The gate's vector, as a one-row f32 matrix (its logit is a matrix product).
    gate_inp: DeviceWeight,
    gate: Arc<DeviceWeight>,
    up: Arc<DeviceWeight>,
    down: Arc<DeviceWeight>,
}

impl SharedDevice {
    /// The shared expert of `gate_inp` (the host vector, for its length, and its device
    /// copy) and its three matrices.
    fn new(
        gate_inp: (&[f32], Arc<GpuBuffer>),
        gate: Arc<DeviceWeight>,
        up: Arc<DeviceWeight>,
        down: Arc<DeviceWeight>,
    ) -> SharedDevice {
        let d = gate_inp.0.len();
        SharedDevice {
            gate_inp: DeviceWeight {
                name: "the shared expert's gate".into(),
                ty: GgmlType::F32,
                rows: 1,
                cols: d,
                row_bytes: 4 * d,
                chunks: vec![WeightChunk {
                    buffer: gate_inp.1,
                    first_row: 0,
                    rows: 1,
                }],
            },
            gate,
            up,
            down,
        }
    }
}

/// `w` is `rows × cols` or an error names it.
fn check_shape(w: &DeviceWeight, rows: usize, cols: usize) -> Result<()> {
    if w.rows != rows || w.cols != cols {
        return Err(Error::ShapeMismatch {
            what: format!(
                "{} ({} rows of {}, expected {rows} of {cols})",
                w.name, w.rows, w.cols
            ),
            expected: rows * cols,
            got: w.rows * w.cols,
        });
    }
    Ok(())
}

impl WgpuBackend {
    /// The device tensors `weights` names in `layer` (`matrix` gives a matrix's device
    /// copy: cached, or in the layer's stream slot); `None` when the layer's table does
    /// not hold the stacked experts (a store fetching the chosen ones on demand), which
    /// the pass then serves at a host sync point.
    pub(super) fn moe_device(
        &self,
        weights: &MoeWeights,
        globals: &GlobalWeights,
        layer: &LayerWeights,
        matrix: impl Fn(WeightRef) -> Result<Arc<DeviceWeight>>,
    ) -> Result<Option<MoeDevice>> {
        let held = [weights.gate, weights.up, weights.down]
            .iter()
            .all(|r| r.matrix(globals, Some(layer)).is_ok());
        if !held {
            return Ok(None);
        }
        let shared = match &weights.shared {
            Some(s) => {
                let v = s.gate_inp.vector(globals, Some(layer))?;
                Some(SharedDevice::new(
                    (v, self.vector(v)?),
                    matrix(s.gate)?,
                    matrix(s.up)?,
                    matrix(s.down)?,
                ))
            }
            None => None,
        };
        Ok(Some(MoeDevice {
            router: matrix(weights.router)?,
            gate: matrix(weights.gate)?,
            up: matrix(weights.up)?,
            down: matrix(weights.down)?,
            shared,
        }))
    }

    /// Records the mixture of experts `spec` over `n` rows of `d` values of `x` into
    /// `out` (see the module doc).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn record_moe(
        &self,
        rec: &mut Recorder<'_>,
        x: &wgpu::Buffer,
        n: usize,
        d: usize,
        w: &MoeDevice,
        spec: &MoeSpec,
        out: &wgpu::Buffer,
    ) -> Result<()> {
        let (ne, k, ff) = (spec.n_expert, spec.n_expert_used, spec.n_ff_expert);
        check_shape(&w.router, ne, d)?;
        check_shape(&w.gate, ne * ff, d)?;
        check_shape(&w.up, ne * ff, d)?;
        check_shape(&w.down, ne * d, ff)?;
        if k == 0 || k > ne {
            return Err(Error::InvalidArgument {
                what: format!("{k} experts used of {ne}"),
            });
        }
        // One workgroup row per (token, choice) pair in the expert products' z.
        let max_z = self.ctx.limits().max_compute_workgroups_per_dimension as usize;
        if n * k > max_z {
            return Err(Error::InvalidArgument {
                what: format!(
                    "{n} tokens of {k} experts each: more (token, expert) pairs than the \
                     device's {max_z} workgroups per dimension; use a smaller batch"
                ),
            });
        }
        let f4 = |values: usize| (values.max(1) * 4) as u64;
        let logits = rec.scratch("moe router logits", 0, f4(n * ne))?;
        self.record_matmul(rec, x, n, d, &[(&w.router, &logits)])?;
        let ids = rec.scratch("moe expert ids", 0, f4(n * k))?;
        let weights = rec.scratch("moe expert weights", 0, f4(n * k))?;
        rec.dispatch(
            &MOE_ROUTE,
            "moe_route",
            &[],
            &[&logits, &ids, &weights],
            Params::new(
                [n as u32, ne as u32, k as u32, u32::from(spec.norm_weights)],
                [0; 4],
                [spec.weights_scale.unwrap_or(1.0), 0.0, 0.0, 0.0],
            ),
            // One workgroup per token row.
            [n as u32, 1, 1],
            "moe_route",
            f4(n * ne),
            f4(2 * n * k),
            0,
        );
        // Each (token, choice) pair is one row from here on.
        let pairs = n * k;
        let gate = rec.scratch("moe gate", 0, f4(pairs * ff))?;
        let up = rec.scratch("moe up", 0, f4(pairs * ff))?;
        let by_token = ExpertRows {
            ids: &ids,
            n_expert: ne,
            n_out: pairs,
            per_input: k,
        };
        self.record_matmul_with(
            rec,
            x,
            n,
            d,
            &[(&w.gate, &gate), (&w.up, &up)],
            Some(&by_token),
        )?;
        let hidden = rec.scratch("moe hidden", 0, f4(pairs * ff))?;
        self.record_elementwise(rec, "swiglu", &[&hidden, &gate, &up], pairs * ff, 1);
        let y = rec.scratch("moe expert outputs", 0, f4(pairs * d))?;
        let by_pair = ExpertRows {
            per_input: 1,
            ..by_token
        };
        self.record_matmul_with(rec, &hidden, pairs, ff, &[(&w.down, &y)], Some(&by_pair))?;
        let params = Params::new([(n * d) as u32, d as u32, k as u32, 0], [0; 4], [0.0; 4]);
        let groups = [(n * d).div_ceil(64) as u32, 1, 1];
        match &w.shared {
            None => rec.dispatch(
                &MOE_COMBINE,
                "moe_combine",
                &[],
                &[out, &y, &weights],
                params,
                groups,
                "moe_combine",
                f4(pairs * d + pairs),
                f4(n * d),
                0,
            ),
            Some(s) => {
                let sf = s.gate.rows;
                check_shape(&s.gate, sf, d)?;
                check_shape(&s.up, sf, d)?;
                check_shape(&s.down, d, sf)?;
                check_shape(&s.gate_inp, 1, d)?;
                let sg = rec.scratch("moe shared gate", 0, f4(n * sf))?;
                let su = rec.scratch("moe shared up", 0, f4(n * sf))?;
                let logit = rec.scratch("moe shared gate logit", 0, f4(n))?;
                self.record_matmul(
                    rec,
                    x,
                    n,
                    d,
                    &[(&s.gate, &sg), (&s.up, &su), (&s.gate_inp, &logit)],
                )?;
                let sh = rec.scratch("moe shared hidden", 0, f4(n * sf))?;
                self.record_elementwise(rec, "swiglu", &[&sh, &sg, &su], n * sf, 1);
                let sy = rec.scratch("moe shared output", 0, f4(n * d))?;
                self.record_matmul(rec, &sh, n, sf, &[(&s.down, &sy)])?;
                rec.dispatch(
                    &MOE_COMBINE,
                    "moe_combine_shared",
                    &[],
                    &[out, &y, &weights, &sy, &logit],
                    params,
                    groups,
                    "moe_combine",
                    f4(pairs * d + pairs + n * d + n),
                    f4(n * d),
                    0,
                );
            }
        }
        Ok(())
    }

    /// Test hook for the routing kernel (`tests/wgpu_moe.rs`): routes `logits`
    /// (`n_expert` per token row) as `spec` says and returns the expert ids and weights,
    /// `n_expert_used` per row in the order of the choice.
    #[doc(hidden)]
    pub fn route_for_test(&self, spec: &MoeSpec, logits: &[f32]) -> Result<(Vec<u32>, Vec<f32>)> {
        let (ne, k) = (spec.n_expert, spec.n_expert_used);
        let n = logits.len() / ne.max(1);
        check_len("router logits", n * ne, logits.len())?;
        let lb = self.upload(bytemuck::cast_slice(logits), "router logits")?;
        let ids = self.scratch((n * k).max(1) * 4, "expert ids")?;
        let weights = self.scratch((n * k).max(1) * 4, "expert weights")?;
        let mut rec = self.recorder();
        rec.dispatch(
            &MOE_ROUTE,
            "moe_route",
            &[],
            &[lb.raw(), ids.raw(), weights.raw()],
            Params::new(
                [n as u32, ne as u32, k as u32, u32::from(spec.norm_weights)],
                [0; 4],
                [spec.weights_scale.unwrap_or(1.0), 0.0, 0.0, 0.0],
            ),
            // One workgroup per token row.
            [n as u32, 1, 1],
            "moe_route",
            0,
            0,
            0,
        );
        let bytes = (n * k * 4) as u64;
        let out = rec
            .finish(&[(ids.raw(), 0, bytes), (weights.raw(), 0, bytes)])?
            .0;
        let (a, b) = out.split_at(bytes as usize);
        Ok((
            bytemuck::pod_collect_to_vec(a),
            bytemuck::pod_collect_to_vec(b),
        ))
    }
}
