//! The three update modes against a naive reference: same live tokens, order and
//! positions after any sequence of appends, evictions, rewinds and clears; attention
//! over each equal within f32 rounding, on the CPU and on wgpu (a ring's two segments
//! and a mask's masked slots included).

use ballast_kv_cache::{new_cache, KvElement, UpdateMode};
use ballast_runtime::backend::AttentionShape;
use ballast_runtime::gpu::GpuContext;
use ballast_runtime::{Backend, CpuBackend, Error, KvCache, KvShape, WgpuBackend};
use half::f16;
use proptest::prelude::*;
use std::sync::Arc;

const SHAPE: KvShape = KvShape {
    n_layers: 2,
    n_kv_heads: 2,
    head_dim: 16,
};
const CAPACITY: usize = 12;

#[derive(Clone, Debug)]
enum Op {
    Append(usize),
    Evict(usize, usize),
    Rewind(usize),
    Clear,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1usize..6).prop_map(Op::Append),
        2 => (0usize..14, 0usize..6).prop_map(|(s, n)| Op::Evict(s, n)),
        1 => (0usize..14).prop_map(Op::Rewind),
        1 => Just(Op::Clear),
    ]
}

/// One token's key and value rows, different for every layer, position and element.
fn rows(layer: usize, pos: u32) -> (Vec<f32>, Vec<f32>) {
    let dim = SHAPE.kv_dim();
    let k = (0..dim)
        .map(|e| ((pos as usize * 31 + e * 7 + layer * 13) % 97) as f32 / 17.0 - 2.5)
        .collect();
    let v = (0..dim)
        .map(|e| ((pos as usize * 17 + e * 11 + layer * 5) % 89) as f32 / 23.0 - 1.5)
        .collect();
    (k, v)
}

type Token = (u32, Vec<f32>, Vec<f32>);

fn round(precision: KvElement, x: &[f32]) -> Vec<f32> {
    match precision {
        KvElement::F16 => x.iter().map(|&v| f16::from_f32(v).to_f32()).collect(),
        _ => x.to_vec(),
    }
}

fn read_all(cache: &dyn KvCache, layer: usize) -> Vec<Token> {
    let (mut p, mut k, mut v) = (vec![], vec![], vec![]);
    cache.read(layer, 0..usize::MAX, &mut p, &mut k, &mut v);
    let dim = SHAPE.kv_dim();
    p.iter()
        .enumerate()
        .map(|(i, &p)| {
            (
                p,
                k[i * dim..(i + 1) * dim].to_vec(),
                v[i * dim..(i + 1) * dim].to_vec(),
            )
        })
        .collect()
}

fn attend(cache: &dyn KvCache, layer: usize, q: &[f32]) -> Vec<f32> {
    attend_on(&CpuBackend::new(1), cache, layer, q)
}

fn attend_on(backend: &dyn Backend, cache: &dyn KvCache, layer: usize, q: &[f32]) -> Vec<f32> {
    let shape = AttentionShape::new(4, SHAPE.n_kv_heads, SHAPE.head_dim);
    let mut out = vec![0f32; q.len()];
    backend
        .attention(q, &[1_000_000], &cache.view(layer), &shape, &mut out)
        .unwrap();
    out
}

fn check(ops: &[Op], precision: KvElement) -> Result<(), TestCaseError> {
    let mut caches: Vec<Box<dyn KvCache>> = UpdateMode::ALL
        .iter()
        .map(|&m| new_cache(m, SHAPE, CAPACITY, precision).unwrap())
        .collect();
    let mut reference: Vec<Vec<Token>> = vec![Vec::new(); SHAPE.n_layers];
    let mut next_pos = 0u32;
    for op in ops {
        match *op {
            Op::Append(n) => {
                let positions: Vec<u32> = (next_pos..next_pos + n as u32).collect();
                next_pos += n as u32;
                let fits = reference[0].len() + n <= CAPACITY;
                for (layer, reference) in reference.iter_mut().enumerate() {
                    let (mut ks, mut vs) = (vec![], vec![]);
                    for &p in &positions {
                        let (k, v) = rows(layer, p);
                        if fits {
                            reference.push((p, round(precision, &k), round(precision, &v)));
                        }
                        ks.extend(k);
                        vs.extend(v);
                    }
                    for cache in &mut caches {
                        let got = cache.append(layer, &positions, &ks, &vs);
                        if fits {
                            prop_assert!(got.is_ok(), "{got:?}");
                        } else {
                            let full = matches!(got, Err(Error::ContextFull { .. }));
                            prop_assert!(full, "{got:?}");
                        }
                    }
                }
            }
            Op::Evict(start, n) => {
                for r in &mut reference {
                    let s = start.min(r.len());
                    r.drain(s..(start + n).min(r.len()).max(s));
                }
                caches.iter_mut().for_each(|c| c.evict(start..start + n));
            }
            Op::Rewind(n) => {
                reference.iter_mut().for_each(|r| r.truncate(n));
                caches.iter_mut().for_each(|c| c.rewind(n));
            }
            Op::Clear => {
                reference.iter_mut().for_each(Vec::clear);
                caches.iter_mut().for_each(|c| c.clear());
            }
        }
        for (cache, mode) in caches.iter().zip(UpdateMode::ALL) {
            prop_assert_eq!(cache.len(), reference[0].len(), "{:?}", mode);
            for (layer, want) in reference.iter().enumerate() {
                prop_assert_eq!(
                    &read_all(cache.as_ref(), layer),
                    want,
                    "{:?} layer {}",
                    mode,
                    layer
                );
                prop_assert_eq!(cache.view(layer).len(), want.len());
            }
            let most = SHAPE.n_layers * CAPACITY * (2 * precision.row_bytes(SHAPE.kv_dim()) + 4);
            prop_assert!(cache.held_bytes().device as usize <= most);
        }
    }
    // Attention over the three equals within f32 rounding.
    let q: Vec<f32> = (0..4 * SHAPE.head_dim)
        .map(|i| (i as f32 * 0.37).sin())
        .collect();
    for layer in 0..SHAPE.n_layers {
        let outs: Vec<Vec<f32>> = caches
            .iter()
            .map(|c| attend(c.as_ref(), layer, &q))
            .collect();
        for (o, mode) in outs.iter().zip(UpdateMode::ALL) {
            for (a, b) in o.iter().zip(&outs[0]) {
                let tol = match precision {
                    KvElement::F16 => 4e-3, // the kernel accumulates in f16 for an f16 cache
                    _ => 1e-5,
                };
                prop_assert!(
                    (a - b).abs() <= tol * (1.0 + b.abs()),
                    "{mode:?}: {a} vs {b}"
                );
            }
        }
    }
    Ok(())
}

/// The three caches after `ops` (appends past the capacity are refused and skipped).
fn after(ops: &[Op], precision: KvElement) -> Vec<Box<dyn KvCache>> {
    let mut caches: Vec<Box<dyn KvCache>> = UpdateMode::ALL
        .iter()
        .map(|&m| new_cache(m, SHAPE, CAPACITY, precision).unwrap())
        .collect();
    let mut next_pos = 0u32;
    for op in ops {
        for cache in &mut caches {
            match *op {
                Op::Append(n) => {
                    if cache.len() + n > CAPACITY {
                        continue;
                    }
                    for layer in 0..SHAPE.n_layers {
                        let (mut ks, mut vs) = (vec![], vec![]);
                        for p in next_pos..next_pos + n as u32 {
                            let (k, v) = rows(layer, p);
                            ks.extend(k);
                            vs.extend(v);
                        }
                        let positions: Vec<u32> = (next_pos..next_pos + n as u32).collect();
                        cache.append(layer, &positions, &ks, &vs).unwrap();
                    }
                }
                Op::Evict(start, n) => cache.evict(start..start + n),
                Op::Rewind(n) => cache.rewind(n),
                Op::Clear => cache.clear(),
            }
        }
        if let Op::Append(n) = *op {
            next_pos += n as u32;
        }
    }
    caches
}

fn gpu() -> Option<Arc<GpuContext>> {
    ballast_runtime::testing::gpu_for_tests()
}

/// Attention on wgpu over each mode's view (ring segments, masked slots) equals the CPU
/// backend's over the shift-concat cache, within the f16 accumulation of the CPU kernel
/// for rounded caches and f32 rounding for f32 ones.
fn check_wgpu(ops: &[Op], precision: KvElement) -> Result<(), TestCaseError> {
    let Some(ctx) = gpu() else { return Ok(()) };
    let wgpu = WgpuBackend::new(ctx);
    let caches = after(ops, precision);
    let q: Vec<f32> = (0..4 * SHAPE.head_dim)
        .map(|i| (i as f32 * 0.37).sin())
        .collect();
    let tol = match precision {
        KvElement::F32 => 1e-5,
        _ => 4e-3,
    };
    for layer in 0..SHAPE.n_layers {
        let want = attend(caches[0].as_ref(), layer, &q);
        for (cache, mode) in caches.iter().zip(UpdateMode::ALL) {
            let got = attend_on(&wgpu, cache.as_ref(), layer, &q);
            for (a, b) in got.iter().zip(&want) {
                prop_assert!(
                    (a - b).abs() <= tol * (1.0 + b.abs()),
                    "{mode:?} {precision:?} layer {layer}: {a} vs {b}"
                );
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]
    #[test]
    fn modes_give_the_same_attention_on_wgpu(
        ops in proptest::collection::vec(op(), 1..30),
        precision in prop_oneof![Just(KvElement::F32), Just(KvElement::F16), Just(KvElement::Q8)],
    ) {
        check_wgpu(&ops, precision)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    #[test]
    fn modes_match_the_reference_f32(ops in proptest::collection::vec(op(), 1..40)) {
        check(&ops, KvElement::F32)?;
    }

    #[test]
    fn modes_match_the_reference_f16(ops in proptest::collection::vec(op(), 1..40)) {
        check(&ops, KvElement::F16)?;
    }
}

/// Byte accounting: evicting the oldest tokens moves nothing in the ring and the
/// mask; shift-concat moves every kept token. Evicting after 4 sinks moves 4 rows in
/// the ring.
#[test]
fn bytes_moved_per_mode() {
    let capacity = 64;
    for mode in UpdateMode::ALL {
        let mut c = new_cache(mode, SHAPE, capacity, KvElement::F16).unwrap();
        for layer in 0..SHAPE.n_layers {
            let (mut ks, mut vs) = (vec![], vec![]);
            for p in 0..capacity as u32 {
                let (k, v) = rows(layer, p);
                ks.extend(k);
                vs.extend(v);
            }
            let positions: Vec<u32> = (0..capacity as u32).collect();
            c.append(layer, &positions, &ks, &vs).unwrap();
        }
        let token = (2 * KvElement::F16.row_bytes(SHAPE.kv_dim()) + 4) as u64;
        let before = c.moved_bytes();
        c.evict(0..1);
        let front = c.moved_bytes() - before;
        c.evict(4..5);
        let sink = c.moved_bytes() - before - front;
        let layers = SHAPE.n_layers as u64;
        match mode {
            UpdateMode::ShiftConcat => {
                assert_eq!(front, 63 * token * layers);
                assert_eq!(sink, 58 * token * layers);
            }
            UpdateMode::PointerShift => {
                assert_eq!(front, 0);
                assert_eq!(sink, 4 * token * layers);
            }
            UpdateMode::SmartMask => {
                assert_eq!(front, 0);
                assert_eq!(sink, 0);
            }
        }
    }
}
