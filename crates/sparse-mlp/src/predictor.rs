//! [`Predictor`]: which neurons a token will use, known before the gate projection is
//! computed, so that the gate's rows of the others are skipped too (Deja Vu's idea,
//! without training).
//!
//! Per layer it is the best rank-`r` approximation of the gate projection on the
//! calibration text's inputs: with `C = E[x xᵀ]` the second moment of the MLP input and
//! `W` the gate weights, the directions `U` (`n_ff × r`, orthonormal) that keep the most
//! of `E‖W x‖²` are the leading left singular vectors of `W L` where `L Lᵀ = C`
//! (reduced-rank regression). The prediction is `ĝ = U (Uᵀ W) x`: two thin products,
//! `project = Uᵀ W` (`r × d`) and `expand = U` (`n_ff × r`), kept in f16. Its error on
//! neuron `j` has the variance `σⱼ² = E[(wⱼ·x − ĝⱼ)²] = ‖(W L)ⱼ‖² − Σₖ Uⱼₖ² sₖ²`, known
//! in closed form from the fit, so a neuron is predicted active when some gate value
//! within `margin · σⱼ` of `ĝⱼ` would pass the layer's threshold: the margin trades
//! bytes for recall, and recall is measured ([`crate::SparseStats::recall`]).

use ballast_core::backend::{Backend, MatmulJob};
use ballast_core::ggml_type::GgmlType;
use ballast_core::weights::{Weight, WeightBytes, WeightId};

use crate::error::{Error, Result};
use crate::linalg;

/// Subspace-iteration rounds of a fit: the leading subspace of a gate projection is
/// well separated, and a rough one only costs recall, which is measured.
const FIT_ITERATIONS: usize = 40;

/// One layer's predictor: `ĝ = expand · (project · x)`, and the error scale per neuron.
#[derive(Clone, Debug)]
pub struct LayerPredictor {
    /// `r × d_model` (row-major, a [`GgmlType::F16`] matrix of `r` rows of `d_model`).
    pub project: Weight,
    /// `n_ff × r` (`n_ff` rows of `r`), f16.
    pub expand: Weight,
    /// Per neuron, the standard deviation of the prediction's error on the
    /// calibration text.
    pub sigma: Vec<f32>,
}

impl LayerPredictor {
    /// A predictor from its matrices as f32 (`project`: `rank × d_model`, `expand`:
    /// `n_ff × rank`, row-major), rounded to f16.
    pub fn new(
        layer: usize,
        d_model: usize,
        n_ff: usize,
        rank: usize,
        project: &[f32],
        expand: &[f32],
        sigma: Vec<f32>,
    ) -> Result<LayerPredictor> {
        if project.len() != rank * d_model || expand.len() != n_ff * rank || sigma.len() != n_ff {
            return Err(Error::InvalidArgument {
                what: format!(
                    "layer {layer}'s predictor: {} + {} + {} values for rank {rank}, width {d_model}, {n_ff} neurons",
                    project.len(),
                    expand.len(),
                    sigma.len()
                ),
            });
        }
        Ok(LayerPredictor {
            project: f16_matrix(
                format!("blk.{layer}.predictor.project"),
                project,
                d_model,
                rank,
            ),
            expand: f16_matrix(format!("blk.{layer}.predictor.expand"), expand, rank, n_ff),
            sigma,
        })
    }

    /// The rank `r`.
    pub fn rank(&self) -> usize {
        self.project.rows()
    }

    /// Weight bytes one token reads to predict.
    pub fn bytes(&self) -> usize {
        self.project.bytes.len() + self.expand.bytes.len()
    }

    /// `ĝ` for `n_tokens` rows of `x` into `out` (`n_tokens × n_ff`), with `hidden` as
    /// scratch.
    pub fn predict(
        &self,
        backend: &dyn Backend,
        x: &[f32],
        n_tokens: usize,
        hidden: &mut Vec<f32>,
        out: &mut [f32],
    ) -> ballast_core::Result<()> {
        hidden.resize(n_tokens * self.rank(), 0.0);
        backend.matmul(
            x,
            n_tokens,
            &mut [MatmulJob {
                weight: &self.project,
                out: hidden,
            }],
        )?;
        backend.matmul(
            hidden,
            n_tokens,
            &mut [MatmulJob {
                weight: &self.expand,
                out,
            }],
        )
    }
}

/// An f16 matrix of `rows` rows of `cols` from row-major f32 values.
fn f16_matrix(name: String, values: &[f32], cols: usize, rows: usize) -> Weight {
    let bytes: Vec<u8> = values
        .iter()
        .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
        .collect();
    Weight {
        name,
        id: WeightId::fresh(),
        ty: GgmlType::F16,
        dims: vec![cols, rows],
        bytes: WeightBytes::from_vec(bytes),
    }
}

/// An f32 matrix of `rows` rows of `cols`, for the fit's products on the backend.
pub(crate) fn f32_matrix(values: &[f32], cols: usize, rows: usize) -> Weight {
    Weight {
        name: "predictor fit".into(),
        id: WeightId::fresh(),
        ty: GgmlType::F32,
        dims: vec![cols, rows],
        bytes: WeightBytes::from_vec(bytemuck::cast_slice(values).to_vec()),
    }
}

/// `weight · xᵢ` for the `n` rows `xᵢ` of `x` on `backend` (`n × weight.rows()`).
fn apply(backend: &dyn Backend, weight: &Weight, x: &[f32], n: usize) -> Result<Vec<f32>> {
    let mut out = vec![0f32; n * weight.rows()];
    backend.matmul(
        x,
        n,
        &mut [MatmulJob {
            weight,
            out: &mut out,
        }],
    )?;
    Ok(out)
}

/// A predictor per layer, with the margin that turns a prediction into a choice.
#[derive(Clone, Debug)]
pub struct Predictor {
    /// Per layer.
    pub layers: Vec<LayerPredictor>,
}

/// Fits layer `layer`'s predictor of rank `rank` for the gate projection `gate`, from
/// the second moment `second_moment` (`d × d`, row-major, `E[x xᵀ]` of the MLP input
/// over the calibration text). The products run on `backend`.
pub fn fit_layer(
    backend: &dyn Backend,
    layer: usize,
    gate: &Weight,
    second_moment: &[f64],
    rank: usize,
) -> Result<LayerPredictor> {
    let (d, n_ff) = (gate.cols(), gate.rows());
    if second_moment.len() != d * d || rank == 0 || rank > d {
        return Err(Error::InvalidArgument {
            what: format!(
                "layer {layer}: a predictor of rank {rank} for a {n_ff} × {d} gate from a second moment of {} values",
                second_moment.len()
            ),
        });
    }
    // W L, column by column: row i of `ml` is W (L eᵢ), so `ml` is (W L)ᵀ, d × n_ff.
    let l = linalg::cholesky(second_moment, d);
    let l_columns: Vec<f32> = (0..d * d)
        .map(|at| l[(at % d) * d + at / d] as f32)
        .collect();
    let ml = apply(backend, gate, &l_columns, d)?;
    // S = (W L)ᵀ (W L), d × d.
    let s32 = apply(backend, &f32_matrix(&ml, n_ff, d), &ml, d)?;
    let s: Vec<f64> = s32.iter().map(|&v| f64::from(v)).collect();
    let (values, v) = linalg::leading_eigenpairs(&s, d, rank, FIT_ITERATIONS);
    // U = W L V Σ⁻¹, kept transposed (rank × n_ff); a direction with no energy stays 0.
    let top = values.first().copied().unwrap_or(0.0);
    let mut u_t = vec![0f32; rank * n_ff];
    for (k, &val) in values.iter().enumerate() {
        if val <= top * 1e-12 || val <= 0.0 {
            continue;
        }
        let inv = (1.0 / val.sqrt()) as f32;
        let row = &mut u_t[k * n_ff..(k + 1) * n_ff];
        for i in 0..d {
            let c = v[i * rank + k] as f32 * inv;
            for (u, &m) in row.iter_mut().zip(&ml[i * n_ff..(i + 1) * n_ff]) {
                *u += c * m;
            }
        }
    }
    // project = Uᵀ W: W's columns come from the identity pushed through the gate.
    let identity: Vec<f32> = (0..d * d)
        .map(|at| f32::from(u8::from(at / d == at % d)))
        .collect();
    let w_t = apply(backend, gate, &identity, d)?;
    let project = apply(backend, &f32_matrix(&w_t, n_ff, d), &u_t, rank)?;
    let expand: Vec<f32> = (0..n_ff * rank)
        .map(|at| u_t[(at % rank) * n_ff + at / rank])
        .collect();
    // σⱼ² = ‖(W L)ⱼ‖² − Σₖ Uⱼₖ² sₖ²: the energy of neuron j's gate the rank misses.
    let sigma: Vec<f32> = (0..n_ff)
        .map(|j| {
            let total: f64 = (0..d).map(|i| f64::from(ml[i * n_ff + j]).powi(2)).sum();
            let kept: f64 = (0..rank)
                .map(|k| f64::from(u_t[k * n_ff + j]).powi(2) * values[k])
                .sum();
            (total - kept).max(0.0).sqrt() as f32
        })
        .collect();
    LayerPredictor::new(layer, d, n_ff, rank, &project, &expand, sigma)
}

/// `silu(g) = g σ(g)`.
pub(crate) fn silu(g: f32) -> f32 {
    g / (1.0 + (-g).exp())
}

/// Where `|silu(g)|` exceeds a threshold `t`: above `above`, and, when `t` is below the
/// depth of SiLU's dip (0.2785 at g = −1.2785), inside the interval `dip` on the
/// negative side.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ActiveRegion {
    /// `|silu(g)| > t` for every `g` above this.
    pub above: f32,
    /// And for `g` strictly inside this interval, if any.
    pub dip: Option<(f32, f32)>,
}

/// Where SiLU bottoms out.
const SILU_MIN_AT: f32 = -1.278_464_5;

impl ActiveRegion {
    /// The region for threshold `t` (at least 0).
    pub fn for_threshold(t: f32) -> ActiveRegion {
        let root = |target: f32, mut lo: f32, mut hi: f32, rising: bool| {
            for _ in 0..100 {
                let mid = 0.5 * (lo + hi);
                if (silu(mid) > target) == rising {
                    hi = mid;
                } else {
                    lo = mid;
                }
            }
            0.5 * (lo + hi)
        };
        let above = root(t, SILU_MIN_AT, t.max(1.0) + 30.0, true);
        let depth = -silu(SILU_MIN_AT);
        let dip = (t < depth).then(|| {
            // silu falls from 0 to its minimum on the left, rises back on the right.
            (
                root(-t, -100.0, SILU_MIN_AT, false),
                root(-t, SILU_MIN_AT, 0.0, true),
            )
        });
        ActiveRegion { above, dip }
    }

    /// True if some gate value in `[lo, hi]` may be active.
    pub fn meets(&self, lo: f32, hi: f32) -> bool {
        hi > self.above || self.dip.is_some_and(|(a, b)| hi > a && lo < b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The region is exactly where |silu| passes the threshold (away from its
        /// edges, within the bisection's precision).
        #[test]
        fn region_is_where_silu_passes(t in 0f32..3.0, g in -12f32..12.0) {
            let r = ActiveRegion::for_threshold(t);
            let inside = r.meets(g, g);
            let near_edge = (g - r.above).abs() < 1e-3
                || r.dip.is_some_and(|(a, b)| (g - a).abs() < 1e-3 || (g - b).abs() < 1e-3);
            prop_assume!(!near_edge);
            prop_assert_eq!(inside, silu(g).abs() > t, "t {} g {} region {:?}", t, g, r);
        }
    }
}
