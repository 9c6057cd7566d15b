//! The little dense linear algebra the predictor's fit needs, in f64 on square
//! `d × d` matrices stored row-major (`d` is the model width, under ten thousand):
//! a Cholesky factor and the leading eigenvectors of a symmetric matrix.

/// The lower-triangular `L` with `L Lᵀ = a + ridge·I` (`a` symmetric, `d × d`), where
/// `ridge` is `1e-6` of the mean diagonal, so that a second moment with directions the
/// calibration text never took (rank-deficient) still factors.
pub fn cholesky(a: &[f64], d: usize) -> Vec<f64> {
    let mean_diag = (0..d).map(|i| a[i * d + i]).sum::<f64>() / d.max(1) as f64;
    let ridge = mean_diag.abs().max(f64::MIN_POSITIVE) * 1e-6;
    let mut l = vec![0f64; d * d];
    for i in 0..d {
        for j in 0..=i {
            let dot: f64 = (0..j).map(|k| l[i * d + k] * l[j * d + k]).sum();
            if i == j {
                let v = a[i * d + i] + ridge - dot;
                // Rounding can leave a tiny negative pivot on a singular direction: the
                // ridge is its floor.
                l[i * d + i] = v.max(ridge).sqrt();
            } else {
                l[i * d + j] = (a[i * d + j] - dot) / l[j * d + j];
            }
        }
    }
    l
}

/// Orthonormalizes the `r` columns of `v` (`d × r`, row-major) in place by modified
/// Gram-Schmidt, twice over; a column that collapses is replaced by a unit vector
/// orthogonal to the ones before it.
fn orthonormalize(v: &mut [f64], d: usize, r: usize) {
    let column_norm =
        |v: &[f64], c: usize| (0..d).map(|i| v[i * r + c].powi(2)).sum::<f64>().sqrt();
    for c in 0..r {
        let before = column_norm(v, c);
        for _pass in 0..2 {
            for p in 0..c {
                let dot: f64 = (0..d).map(|i| v[i * r + c] * v[i * r + p]).sum();
                (0..d).for_each(|i| v[i * r + c] -= dot * v[i * r + p]);
            }
        }
        // A column left with less than 1e-8 of its length lies (to rounding) in the
        // span of the ones before: normalizing it would amplify the rounding.
        let norm = column_norm(v, c);
        if norm > 1e-8 * before && norm > 1e-150 {
            (0..d).for_each(|i| v[i * r + c] /= norm);
            continue;
        }
        // A basis vector the others do not span (one exists since c < r <= d).
        for e in 0..d {
            (0..d).for_each(|i| v[i * r + c] = f64::from(u8::from(i == e)));
            for p in 0..c {
                let dot = v[e * r + p];
                (0..d).for_each(|i| v[i * r + c] -= dot * v[i * r + p]);
            }
            let norm = column_norm(v, c);
            if norm > 1e-6 {
                (0..d).for_each(|i| v[i * r + c] /= norm);
                break;
            }
        }
    }
}

/// `a · v` for `a` `d × d` and `v` `d × r`, both row-major.
fn multiply(a: &[f64], v: &[f64], d: usize, r: usize) -> Vec<f64> {
    let mut out = vec![0f64; d * r];
    for i in 0..d {
        let row = &mut out[i * r..(i + 1) * r];
        for (k, &aik) in a[i * d..(i + 1) * d].iter().enumerate() {
            for (o, &vk) in row.iter_mut().zip(&v[k * r..(k + 1) * r]) {
                *o += aik * vk;
            }
        }
    }
    out
}

/// The `r` leading eigenpairs of the symmetric positive semi-definite `a` (`d × d`):
/// eigenvalues descending, and the eigenvectors as the columns of a `d × r` row-major
/// matrix. Subspace iteration (`iterations` rounds) with a Rayleigh-Ritz step at the
/// end: the predictor needs the leading subspace, not the last bit of each vector.
pub fn leading_eigenpairs(
    a: &[f64],
    d: usize,
    r: usize,
    iterations: usize,
) -> (Vec<f64>, Vec<f64>) {
    let r = r.min(d);
    // A fixed start (a fit is reproducible) with weight on every coordinate, so that
    // no eigenvector starts orthogonal to it.
    let mut v: Vec<f64> = (0..d * r)
        .map(|i| {
            let (row, col) = (i / r, i % r);
            ((row * 7 + col * 13 + 1) as f64 * 0.618_033_988_75).fract() - 0.5
        })
        .collect();
    orthonormalize(&mut v, d, r);
    for _ in 0..iterations {
        v = multiply(a, &v, d, r);
        orthonormalize(&mut v, d, r);
    }
    // Rayleigh-Ritz: the small r × r problem Vᵀ A V, solved by Jacobi rotations, orders
    // and refines the directions within the subspace.
    let av = multiply(a, &v, d, r);
    let mut h = vec![0f64; r * r];
    for p in 0..r {
        for q in 0..r {
            h[p * r + q] = (0..d).map(|i| v[i * r + p] * av[i * r + q]).sum();
        }
    }
    let (values, rotation) = jacobi_eigen(&mut h, r);
    let mut order: Vec<usize> = (0..r).collect();
    order.sort_by(|&x, &y| values[y].total_cmp(&values[x]));
    let mut vectors = vec![0f64; d * r];
    for i in 0..d {
        for (c, &o) in order.iter().enumerate() {
            vectors[i * r + c] = (0..r).map(|p| v[i * r + p] * rotation[p * r + o]).sum();
        }
    }
    (order.iter().map(|&o| values[o].max(0.0)).collect(), vectors)
}

/// Eigen-decomposition of the small symmetric `h` (`r × r`, destroyed) by cyclic Jacobi
/// rotations: the eigenvalues, and the eigenvectors as the columns of an `r × r` matrix.
fn jacobi_eigen(h: &mut [f64], r: usize) -> (Vec<f64>, Vec<f64>) {
    let mut rotation = vec![0f64; r * r];
    (0..r).for_each(|i| rotation[i * r + i] = 1.0);
    for _sweep in 0..64 {
        let off: f64 = (0..r)
            .flat_map(|p| (0..r).filter(move |&q| q != p).map(move |q| (p, q)))
            .map(|(p, q)| h[p * r + q].powi(2))
            .sum();
        let diagonal: f64 = (0..r).map(|p| h[p * r + p].powi(2)).sum();
        if off <= 1e-28 * diagonal.max(f64::MIN_POSITIVE) {
            break;
        }
        for p in 0..r {
            for q in p + 1..r {
                let apq = h[p * r + q];
                if apq == 0.0 {
                    continue;
                }
                let theta = (h[q * r + q] - h[p * r + p]) / (2.0 * apq);
                let t = if theta == 0.0 {
                    1.0
                } else {
                    theta.signum() / (theta.abs() + (theta * theta + 1.0).sqrt())
                };
                let c = 1.0 / (t * t + 1.0).sqrt();
                let s = t * c;
                for k in 0..r {
                    let (hkp, hkq) = (h[k * r + p], h[k * r + q]);
                    h[k * r + p] = c * hkp - s * hkq;
                    h[k * r + q] = s * hkp + c * hkq;
                }
                for k in 0..r {
                    let (hpk, hqk) = (h[p * r + k], h[q * r + k]);
                    h[p * r + k] = c * hpk - s * hqk;
                    h[q * r + k] = s * hpk + c * hqk;
                }
                for k in 0..r {
                    let (vkp, vkq) = (rotation[k * r + p], rotation[k * r + q]);
                    rotation[k * r + p] = c * vkp - s * vkq;
                    rotation[k * r + q] = s * vkp + c * vkq;
                }
            }
        }
    }
    ((0..r).map(|i| h[i * r + i]).collect(), rotation)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn pseudo_random(n: usize, seed: u64) -> Vec<f64> {
        (0..n)
            .map(|i| (((i as u64 + 3).wrapping_mul(seed | 1)) % 997) as f64 / 498.0 - 1.0)
            .collect()
    }

    proptest! {
        /// L Lᵀ gives back any Gram matrix, full rank or not (plus the tiny ridge).
        #[test]
        fn cholesky_factors(d in 1usize..12, n in 1usize..16, seed in any::<u64>()) {
            let b = pseudo_random(d * n, seed);
            let a: Vec<f64> = (0..d * d)
                .map(|at| (0..n).map(|k| b[(at / d) * n + k] * b[(at % d) * n + k]).sum())
                .collect();
            let l = cholesky(&a, d);
            let scale = (0..d).map(|i| a[i * d + i]).fold(1e-9, f64::max);
            for i in 0..d {
                for j in 0..d {
                    let v: f64 = (0..d).map(|k| l[i * d + k] * l[j * d + k]).sum();
                    prop_assert!((v - a[i * d + j]).abs() <= 1e-4 * scale, "{i},{j}: {v} vs {}", a[i * d + j]);
                }
            }
        }

        /// For A = Q diag(λ) Qᵀ with λᵢ = 2⁻ⁱ, the leading pairs found are (λᵢ, qᵢ):
        /// the values, and A v = λ v.
        #[test]
        fn leading_eigenpairs_are_eigenpairs(d in 2usize..10, r in 1usize..4, seed in any::<u64>()) {
            let r = r.min(d);
            let mut q = pseudo_random(d * d, seed);
            orthonormalize(&mut q, d, d);
            let lambda: Vec<f64> = (0..d).map(|i| 0.5f64.powi(i as i32)).collect();
            let a: Vec<f64> = (0..d * d)
                .map(|at| (0..d).map(|k| q[(at / d) * d + k] * lambda[k] * q[(at % d) * d + k]).sum())
                .collect();
            let (values, vectors) = leading_eigenpairs(&a, d, r, 200);
            for c in 0..r {
                prop_assert!((values[c] - lambda[c]).abs() < 1e-9, "{values:?}");
                for i in 0..d {
                    let av: f64 = (0..d).map(|k| a[i * d + k] * vectors[k * r + c]).sum();
                    prop_assert!((av - values[c] * vectors[i * r + c]).abs() <= 1e-9, "pair {c}");
                }
            }
        }
    }
}
