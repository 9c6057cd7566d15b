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

/// The ridge of the attention-input regression, as a fraction of `E[a aᵀ]`'s mean
/// diagonal.
const ATTENTION_RIDGE: f64 = 1e-2;

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

/// The best rank-`r` directions of a gate projection `W` (`n_ff × d`) whose energy is
/// measured through a `d × d` factor `F` (row-major): the leading left singular vectors
/// `U` of `W F`, their squared singular values, and `(W F)ᵀ`.
struct RankFit {
    /// `Uᵀ`, `rank × n_ff`; a direction with no energy is 0.
    u_t: Vec<f32>,
    /// `sₖ²`, descending.
    values: Vec<f64>,
    /// `(W F)ᵀ`, `d × n_ff`.
    wf_t: Vec<f32>,
}

impl RankFit {
    /// `Σₖ Uⱼₖ² sₖ²`: the energy of neuron `j`'s gate the rank keeps.
    fn kept(&self, j: usize, n_ff: usize) -> f64 {
        self.values
            .iter()
            .enumerate()
            .map(|(k, &val)| f64::from(self.u_t[k * n_ff + j]).powi(2) * val)
            .sum()
    }
}

fn fit_rank(backend: &dyn Backend, gate: &Weight, factor: &[f64], rank: usize) -> Result<RankFit> {
    let (d, n_ff) = (gate.cols(), gate.rows());
    // W F, column by column: row i of `wf_t` is W (F eᵢ), so `wf_t` is (W F)ᵀ.
    let f_columns: Vec<f32> = (0..d * d)
        .map(|at| factor[(at % d) * d + at / d] as f32)
        .collect();
    let wf_t = apply(backend, gate, &f_columns, d)?;
    // S = (W F)ᵀ (W F), d × d.
    let s32 = apply(backend, &f32_matrix(&wf_t, n_ff, d), &wf_t, d)?;
    let s: Vec<f64> = s32.iter().map(|&v| f64::from(v)).collect();
    let (values, v) = linalg::leading_eigenpairs(&s, d, rank, FIT_ITERATIONS);
    // U = W F V Σ⁻¹, kept transposed.
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
            for (u, &m) in row.iter_mut().zip(&wf_t[i * n_ff..(i + 1) * n_ff]) {
                *u += c * m;
            }
        }
    }
    Ok(RankFit { u_t, values, wf_t })
}

/// `Uᵀ W` (`rank × d`): W's columns come from the identity pushed through the gate.
fn project_gate(
    backend: &dyn Backend,
    gate: &Weight,
    u_t: &[f32],
    rank: usize,
) -> Result<Vec<f32>> {
    let (d, n_ff) = (gate.cols(), gate.rows());
    let identity: Vec<f32> = (0..d * d)
        .map(|at| f32::from(u8::from(at / d == at % d)))
        .collect();
    let w_t = apply(backend, gate, &identity, d)?;
    apply(backend, &f32_matrix(&w_t, n_ff, d), u_t, rank)
}

/// `n_ff × rank` from its transpose.
fn transposed(u_t: &[f32], rank: usize, n_ff: usize) -> Vec<f32> {
    (0..n_ff * rank)
        .map(|at| u_t[(at % rank) * n_ff + at / rank])
        .collect()
}

/// Checks the arguments of a fit: `moments` of `d × d` values each.
fn check_fit(layer: usize, gate: &Weight, rank: usize, moments: &[&[f64]]) -> Result<()> {
    let (d, n_ff) = (gate.cols(), gate.rows());
    if let Some(bad) = moments.iter().find(|m| m.len() != d * d) {
        return Err(Error::InvalidArgument {
            what: format!(
                "layer {layer}: a predictor for a {n_ff} × {d} gate from a moment of {} values",
                bad.len()
            ),
        });
    }
    if rank == 0 || rank > d {
        return Err(Error::InvalidArgument {
            what: format!("layer {layer}: a predictor of rank {rank} for a gate of width {d}"),
        });
    }
    Ok(())
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
    check_fit(layer, gate, rank, &[second_moment])?;
    let (d, n_ff) = (gate.cols(), gate.rows());
    let fit = fit_rank(backend, gate, &linalg::cholesky(second_moment, d), rank)?;
    let project = project_gate(backend, gate, &fit.u_t, rank)?;
    // σⱼ² = ‖(W L)ⱼ‖² − Σₖ Uⱼₖ² sₖ²: the energy of neuron j's gate the rank misses.
    let sigma: Vec<f32> = (0..n_ff)
        .map(|j| {
            let total: f64 = (0..d)
                .map(|i| f64::from(fit.wf_t[i * n_ff + j]).powi(2))
                .sum();
            (total - fit.kept(j, n_ff)).max(0.0).sqrt() as f32
        })
        .collect();
    let expand = transposed(&fit.u_t, rank, n_ff);
    LayerPredictor::new(layer, d, n_ff, rank, &project, &expand, sigma)
}

/// Fits layer `layer`'s predictor of the gate from the layer's *attention* input `a`
/// (Deja Vu's choice: known before attention runs, so the neurons can be fetched
/// meanwhile), by reduced-rank regression of `g = W x` on `a`, from the moments over
/// the calibration text: `xx = E[x xᵀ]`, `xa = E[x aᵀ]` (row `i`: MLP input
/// coordinate `i`), `aa = E[a aᵀ]`, each `d × d` row-major.
///
/// The least-squares map is `B = W M` with `M = E[x aᵀ] E[a aᵀ]⁻¹`; the rank-`r` one
/// keeps the leading left singular vectors `U` of `B L` (`L Lᵀ = E[a aᵀ]`), and
/// `B L = W K` with `K = E[x aᵀ] L⁻ᵀ`, so the fit is [`fit_layer`]'s on the factor `K`.
/// The prediction is `ĝ = U (Uᵀ W M) a`; its error on neuron `j` has the variance
/// `E[gⱼ²] − Σₖ Uⱼₖ² sₖ²` (the regression's residual is orthogonal to `a`), with
/// `E[gⱼ²] = wⱼᵀ E[x xᵀ] wⱼ`.
pub fn fit_attention_layer(
    backend: &dyn Backend,
    layer: usize,
    gate: &Weight,
    xx: &[f64],
    xa: &[f64],
    aa: &[f64],
    rank: usize,
) -> Result<LayerPredictor> {
    check_fit(layer, gate, rank, &[xx, xa, aa])?;
    let (d, n_ff) = (gate.cols(), gate.rows());
    // Ridge regression: without it the map fits the calibration text's quirks in the
    // attention input's weak directions (a few thousand tokens for `d²` coefficients).
    let mean_diag = (0..d).map(|i| aa[i * d + i]).sum::<f64>() / d as f64;
    let mut aa = aa.to_vec();
    for i in 0..d {
        aa[i * d + i] += ATTENTION_RIDGE * mean_diag;
    }
    let la = linalg::cholesky(&aa, d);
    // K = E[x aᵀ] L⁻ᵀ: row i solves L kᵢᵀ = (row i of E[x aᵀ])ᵀ, forward substitution.
    let mut k = vec![0f64; d * d];
    for i in 0..d {
        let (row, s) = (&mut k[i * d..(i + 1) * d], &xa[i * d..(i + 1) * d]);
        for j in 0..d {
            let dot: f64 = (0..j).map(|m| la[j * d + m] * row[m]).sum();
            row[j] = (s[j] - dot) / la[j * d + j];
        }
    }
    let fit = fit_rank(backend, gate, &k, rank)?;
    let project_x = project_gate(backend, gate, &fit.u_t, rank)?;
    // Uᵀ W M = (Uᵀ W) K L⁻¹, row by row: q = p K, then y L = q by back substitution.
    let mut project = vec![0f32; rank * d];
    for (p, out) in project_x.chunks_exact(d).zip(project.chunks_exact_mut(d)) {
        let mut q = vec![0f64; d];
        for (i, &pi) in p.iter().enumerate() {
            for (qj, &kij) in q.iter_mut().zip(&k[i * d..(i + 1) * d]) {
                *qj += f64::from(pi) * kij;
            }
        }
        let mut y = vec![0f64; d];
        for j in (0..d).rev() {
            let later: f64 = (j + 1..d).map(|i| y[i] * la[i * d + j]).sum();
            y[j] = (q[j] - later) / la[j * d + j];
        }
        for (o, v) in out.iter_mut().zip(&y) {
            *o = *v as f32;
        }
    }
    // E[gⱼ²] = ‖(W Lₓ)ⱼ‖² with Lₓ Lₓᵀ = E[x xᵀ].
    let lx = linalg::cholesky(xx, d);
    let lx_columns: Vec<f32> = (0..d * d)
        .map(|at| lx[(at % d) * d + at / d] as f32)
        .collect();
    let wl_t = apply(backend, gate, &lx_columns, d)?;
    let sigma: Vec<f32> = (0..n_ff)
        .map(|j| {
            let total: f64 = (0..d).map(|i| f64::from(wl_t[i * n_ff + j]).powi(2)).sum();
            (total - fit.kept(j, n_ff)).max(0.0).sqrt() as f32
        })
        .collect();
    let expand = transposed(&fit.u_t, rank, n_ff);
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

    /// How deep `g` lies inside the region: positive inside (the distance to its
    /// nearest edge), negative outside (minus the distance to it). So `g ± m` meets
    /// the region exactly when the depth exceeds `−m`.
    pub fn depth(&self, g: f32) -> f32 {
        let above = g - self.above;
        let dip = self.dip.map_or(f32::NEG_INFINITY, |(a, b)| {
            if g > a && g < b {
                (g - a).min(b - g)
            } else {
                -(a - g).max(g - b)
            }
        });
        above.max(dip)
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

        /// `g ± m` meets the region exactly when its depth exceeds `−m`.
        #[test]
        fn depth_agrees_with_meets(t in 0f32..3.0, g in -12f32..12.0, m in 0f32..3.0) {
            let r = ActiveRegion::for_threshold(t);
            let depth = r.depth(g);
            prop_assume!((depth + m).abs() > 1e-4);
            prop_assert_eq!(r.meets(g - m, g + m), depth > -m, "t {} g {} m {} depth {}", t, g, m, depth);
        }
    }
}
