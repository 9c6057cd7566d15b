//! The wgpu KV-write kernel (`kv_write.wgsl`): random f32 rows written at random
//! distinct slots of a keys or values buffer in its stored type must give, bit for bit,
//! what the host's conversion gives (f16: `half::f16::from_f32`; q8: ggml's `q8_0`
//! block quantization as kv-cache's `quantize_block` does it, restated here), and leave
//! every other slot's bytes as they were, including halves of words shared with a
//! written row. Values span many binades (f16 subnormals and overflow, q8 blocks from
//! f32 subnormals to large ones) and q8 blocks with exact rounding ties.
//!
//! Needs a wgpu adapter: under CI (`CI` set) a missing one fails; elsewhere the tests
//! skip with a printed reason.
#![cfg(feature = "gpu")]

use std::sync::{Arc, OnceLock};

use ballast_runtime::kv::{KvRows, Q8_BLOCK};
use ballast_runtime::WgpuBackend;
use half::f16;
use proptest::prelude::*;

fn backend() -> Option<Arc<WgpuBackend>> {
    static BACKEND: OnceLock<Option<Arc<WgpuBackend>>> = OnceLock::new();
    BACKEND
        .get_or_init(|| {
            ballast_runtime::testing::gpu_for_tests().map(|c| Arc::new(WgpuBackend::new(c)))
        })
        .clone()
}

/// A xorshift stream from a seed.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// A finite f32 of random sign and mantissa with its exponent in `exps` (below -126,
    /// a subnormal of that magnitude), or zero one time in sixteen.
    fn float(&mut self, exps: std::ops::Range<i32>) -> f32 {
        if self.below(16) == 0 {
            return 0.0;
        }
        let e = exps.start + self.below((exps.end - exps.start) as u64) as i32;
        let sign = (self.below(2) as u32) << 31;
        let man = self.next() as u32 & 0x7f_ffff;
        let bits = if e >= -126 {
            ((e + 127) as u32) << 23 | man
        } else {
            (0x80_0000 | man) >> (-126 - e).min(24)
        };
        f32::from_bits(sign | bits)
    }
}

/// ggml's `quantize_row_q8_0` on one block, as the host cache rounds: `d = amax / 127`,
/// quants `round(x / d)` half away from zero (via `1 / d`), saturated to i8.
fn q8_block(x: &[f32]) -> (Vec<i8>, f16) {
    let amax = x.iter().map(|v| v.abs()).fold(0f32, f32::max);
    let d = amax / 127.0;
    let inv = if d == 0.0 { 0.0 } else { d.recip() };
    (
        x.iter().map(|&v| (v * inv).round() as i8).collect(),
        f16::from_f32(d),
    )
}

#[derive(Clone, Copy, Debug)]
enum Elem {
    F32,
    F16,
    Q8,
}

/// Rows of `dim` for one case: for q8 each block has its own magnitude, and one block
/// in four has amax 127 (so d = 1) and values on exact halves, where Rust's rounding
/// (away from zero) and WGSL's `round` (to even) part.
fn rows(rng: &mut Rng, elem: Elem, n: usize, dim: usize) -> Vec<f32> {
    match elem {
        Elem::F32 => (0..n * dim).map(|_| rng.float(-40..40)).collect(),
        // f16 subnormals start below 2^-14, and values from 65520 up overflow to inf.
        Elem::F16 => (0..n * dim).map(|_| rng.float(-27..18)).collect(),
        Elem::Q8 => {
            let mut out = Vec::with_capacity(n * dim);
            for _ in 0..n * dim / Q8_BLOCK {
                if rng.below(4) == 0 {
                    let at = rng.below(Q8_BLOCK as u64) as usize;
                    for j in 0..Q8_BLOCK {
                        let half = rng.below(253) as f32 - 126.0 + 0.5;
                        out.push(if j == at { 127.0 } else { half });
                    }
                } else if rng.below(8) == 0 {
                    // Near and below the f32 normal range: d subnormal, 1 / d huge.
                    let top = -(rng.below(12) as i32) - 118;
                    out.extend((0..Q8_BLOCK).map(|_| rng.float(top - 4..top + 1)));
                } else {
                    let top = rng.below(40) as i32 - 20;
                    out.extend((0..Q8_BLOCK).map(|_| rng.float(top - 8..top + 1)));
                }
            }
            out
        }
    }
}

fn pad4(mut b: Vec<u8>) -> Vec<u8> {
    b.resize(b.len().next_multiple_of(4), 0);
    b
}

/// Writes `src` at `slots` of an f32 or f16 `cache` (`wrap` says which) on the device;
/// returns its bytes and what the host makes of the same write (`convert` per element).
fn write_plain<T: bytemuck::Pod>(
    be: &WgpuBackend,
    mut cache: Vec<T>,
    wrap: fn(&[T]) -> KvRows<'_>,
    convert: fn(f32) -> T,
    dim: usize,
    src: &[f32],
    slots: &[u32],
) -> (Vec<u8>, Vec<u8>) {
    let got = be
        .write_kv_rows_for_test(wrap(&cache), dim, src, slots)
        .unwrap();
    for (r, &s) in slots.iter().enumerate() {
        let row = &mut cache[s as usize * dim..][..dim];
        for (c, &v) in row.iter_mut().zip(&src[r * dim..][..dim]) {
            *c = convert(v);
        }
    }
    (got, pad4(bytemuck::cast_slice(&cache).to_vec()))
}

fn check(
    elem: Elem,
    dim: usize,
    capacity: usize,
    n: usize,
    seed: u64,
) -> Result<(), TestCaseError> {
    let Some(be) = backend() else { return Ok(()) };
    let mut rng = Rng::new(seed);
    // Distinct slots in random order: a partial shuffle of 0..capacity.
    let mut all: Vec<u32> = (0..capacity as u32).collect();
    for i in 0..n {
        let j = i + rng.below((capacity - i) as u64) as usize;
        all.swap(i, j);
    }
    let slots = &all[..n];
    let src = rows(&mut rng, elem, n, dim);
    // The cache before the write: random stored bytes, which unwritten slots keep.
    let len = capacity * dim;
    let (got, want) = match elem {
        Elem::F32 => {
            let cache = (0..len).map(|_| f32::from_bits(rng.next() as u32));
            write_plain(
                &be,
                cache.collect(),
                |c| KvRows::F32(c),
                |v| v,
                dim,
                &src,
                slots,
            )
        }
        Elem::F16 => {
            let cache = (0..len).map(|_| f16::from_bits(rng.next() as u16));
            write_plain(
                &be,
                cache.collect(),
                |c| KvRows::F16(c),
                f16::from_f32,
                dim,
                &src,
                slots,
            )
        }
        Elem::Q8 => {
            let nb = dim / Q8_BLOCK;
            let mut quants: Vec<i8> = (0..len).map(|_| rng.next() as i8).collect();
            let mut scales: Vec<f16> = (0..capacity * nb)
                .map(|_| f16::from_bits(rng.next() as u16))
                .collect();
            let got = be
                .write_kv_rows_for_test(
                    KvRows::Q8 {
                        quants: &quants,
                        scales: &scales,
                    },
                    dim,
                    &src,
                    slots,
                )
                .unwrap();
            for (r, &s) in slots.iter().enumerate() {
                let s = s as usize;
                for b in 0..nb {
                    let (q, d) = q8_block(&src[r * dim + b * Q8_BLOCK..][..Q8_BLOCK]);
                    quants[s * dim + b * Q8_BLOCK..][..Q8_BLOCK].copy_from_slice(&q);
                    scales[s * nb + b] = d;
                }
            }
            let mut want = pad4(bytemuck::cast_slice(&quants).to_vec());
            want.extend_from_slice(bytemuck::cast_slice(&scales));
            (got, pad4(want))
        }
    };
    prop_assert_eq!(got.len(), want.len());
    if let Some(at) = (0..got.len()).find(|&i| got[i] != want[i]) {
        let slot_bytes = match elem {
            Elem::F32 => 4 * dim,
            Elem::F16 => 2 * dim,
            Elem::Q8 => dim,
        };
        return Err(TestCaseError::fail(format!(
            "{elem:?}, dim {dim}: byte {at} is {:#04x}, the host gives {:#04x} (slot {} if among the \
             elements; written slots {slots:?})",
            got[at],
            want[at],
            at / slot_bytes
        )));
    }
    Ok(())
}

fn elem() -> impl Strategy<Value = Elem> {
    prop_oneof![Just(Elem::F32), Just(Elem::F16), Just(Elem::Q8)]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// f16 rows of any length (odd ones share words), q8 rows of whole blocks.
    #[test]
    fn rows_are_written_as_the_host_converts_them(
        elem in elem(),
        len in 1usize..70,
        capacity in 1usize..12,
        written in 0usize..12,
        seed in any::<u64>(),
    ) {
        let dim = match elem {
            Elem::Q8 => len.div_ceil(Q8_BLOCK) * Q8_BLOCK,
            _ => len,
        };
        check(elem, dim, capacity, written.min(capacity), seed)?;
    }
}

/// A q8 row whose length is not whole blocks, and slots or row counts that do not fit,
/// are errors that name the problem.
#[test]
fn bad_writes_are_named_errors() {
    let Some(be) = backend() else { return };
    let (quants, scales) = ([0i8; 96], [f16::ZERO; 3]);
    let cache = KvRows::Q8 {
        quants: &quants,
        scales: &scales,
    };
    let err = be
        .write_kv_rows_for_test(cache, 48, &[0.0; 48], &[0])
        .unwrap_err();
    assert!(err.to_string().contains("multiple of 32"), "{err}");
    let halves = [f16::ZERO; 8];
    let err = be
        .write_kv_rows_for_test(KvRows::F16(&halves), 4, &[0.0; 4], &[2])
        .unwrap_err();
    assert!(err.to_string().contains("slot 2"), "{err}");
    let err = be
        .write_kv_rows_for_test(KvRows::F16(&halves), 4, &[0.0; 3], &[0])
        .unwrap_err();
    assert!(err.to_string().contains("KV rows to write"), "{err}");
}
