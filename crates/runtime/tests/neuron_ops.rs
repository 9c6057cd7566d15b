//! The CPU backend's neuron stores and neuron MLP ([`NeuronOps`]): each neuron's hidden
//! value equals the dense MLP's bit for bit, the down sum equals the scalar reference
//! in the order given (and an f64 reference within rounding), on every SIMD level and
//! thread count; malformed jobs are refused.

use ballast_runtime::backend::ops::*;
use ballast_runtime::backend::MatmulJob;
use ballast_runtime::ggml_type::GgmlType;
use ballast_runtime::neurons::{axpy_row, quantize_q8_0, NeuronLayout, NeuronMlpJob, NeuronOps};
use ballast_runtime::quant::{self, SimdLevel};
use ballast_runtime::weights::Weight;
use ballast_runtime::CpuBackend;
use proptest::prelude::*;

use ballast_runtime::testing::seeded_values as values;

fn weight(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Weight {
    ballast_runtime::testing::seeded_weight("ffn_up.weight", ty, rows, cols, seed)
}

/// Records of every neuron of `up` with down columns `down` (`n_embd × n_ff`,
/// row-major, as `ffn_down` is) stored as `down_type`.
fn records(up: &Weight, down: &[f32], layout: &NeuronLayout) -> Vec<u8> {
    let (n_embd, n_ff) = (layout.n_embd, up.rows());
    let mut out = Vec::new();
    for j in 0..n_ff {
        out.extend_from_slice(
            &up.bytes.as_slice().unwrap()[j * up.row_bytes()..][..up.row_bytes()],
        );
        let column: Vec<f32> = (0..n_embd).map(|r| down[r * n_ff + j]).collect();
        match layout.down_type {
            GgmlType::Q8_0 => quantize_q8_0(&column, &mut out),
            GgmlType::F16 => out.extend(
                column
                    .iter()
                    .flat_map(|v| half::f16::from_f32(*v).to_le_bytes()),
            ),
            _ => out.extend(column.iter().flat_map(|v| v.to_le_bytes())),
        }
    }
    out
}

const UP_TYPES: [GgmlType; 5] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::F32,
];

/// A store holding every neuron of a random layer in a shuffled order of slots, and
/// the slot of each neuron.
fn store_of(
    be: &CpuBackend,
    id: u64,
    up: &Weight,
    down: &[f32],
    layout: &NeuronLayout,
    seed: u64,
) -> Vec<u32> {
    let n_ff = up.rows();
    let capacity = n_ff + 3;
    let mut slot_of: Vec<u32> = (0..capacity as u32).collect();
    // A seeded shuffle, so neuron j's slot is not j.
    let r = values(seed, capacity, 1.0);
    slot_of.sort_by(|a, b| r[*a as usize].total_cmp(&r[*b as usize]));
    slot_of.truncate(n_ff);
    be.neuron_slots_create(id, capacity, layout).unwrap();
    be.neuron_slots_write(id, &slot_of, &records(up, down, layout))
        .unwrap();
    slot_of
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// With one-hot F32 down columns, the output is each neuron's hidden value: it must
    /// be the dense MLP's (matmul of `ffn_up`, then swiglu) bit for bit.
    #[test]
    fn hidden_values_equal_the_dense_mlps(ty in 0..UP_TYPES.len(), n_tokens in 1usize..11, threads in 1usize..3, seed in any::<u64>()) {
        let ty = UP_TYPES[ty];
        let n_embd = if ty == GgmlType::Q4_K { 256 } else { 96 };
        let n_ff = 40;
        let up = weight(ty, n_ff, n_embd, seed);
        let mut down = vec![0f32; n_embd * n_ff];
        for j in 0..n_ff {
            down[j * n_ff + j] = 1.0;
        }
        let layout = NeuronLayout { n_embd, up_type: ty, down_type: GgmlType::F32 };
        let be = CpuBackend::new(threads);
        let slot_of = store_of(&be, 7, &up, &down, &layout, seed ^ 1);
        let x = values(seed ^ 2, n_tokens * n_embd, 1.0);
        let gate = values(seed ^ 3, n_tokens * n_ff, 3.0);
        let mut dense_up = vec![0f32; n_tokens * n_ff];
        be.matmul(&x, n_tokens, &mut [MatmulJob { weight: &up, out: &mut dense_up }]).unwrap();
        let mut hidden = vec![0f32; n_tokens * n_ff];
        be.swiglu(&gate, &dense_up, &mut hidden).unwrap();
        // Every other neuron, in reverse order; some tokens drop some of them.
        let chosen: Vec<usize> = (0..n_ff).rev().step_by(2).collect();
        let slots: Vec<u32> = chosen.iter().map(|&j| slot_of[j]).collect();
        let k = chosen.len();
        let g: Vec<f32> = (0..n_tokens * k).map(|a| gate[a / k * n_ff + chosen[a % k]]).collect();
        let keep: Vec<bool> = (0..n_tokens * k).map(|a| (a * 7 + seed as usize) % 5 != 0).collect();
        let mut out = vec![f32::NAN; n_tokens * n_embd];
        be.neuron_mlp(NeuronMlpJob { store: 7, x: &x, n_tokens, slots: &slots, gate: &g, keep: &keep, out: &mut out }).unwrap();
        for t in 0..n_tokens {
            for (i, &j) in chosen.iter().enumerate() {
                let want = if keep[t * k + i] { hidden[t * n_ff + j] } else { 0.0 };
                prop_assert_eq!(out[t * n_embd + j].to_bits(), want.to_bits(), "token {} neuron {}", t, j);
            }
            for j in (0..n_embd).filter(|j| !chosen.contains(j)) {
                prop_assert_eq!(out[t * n_embd + j], 0.0);
            }
        }
    }

    /// Q8_0 and F16 down columns: the output is the scalar reference's sum in the order
    /// given, bit for bit, and an f64 sum within rounding; the thread count changes no bit.
    #[test]
    fn down_sums_follow_the_reference(ty in 0..UP_TYPES.len(), f16_down in any::<bool>(), n_tokens in 1usize..6, seed in any::<u64>()) {
        let ty = UP_TYPES[ty];
        let n_embd = if ty == GgmlType::Q4_K { 256 } else { 128 };
        let n_ff = 48;
        let down_type = if f16_down { GgmlType::F16 } else { GgmlType::Q8_0 };
        let up = weight(ty, n_ff, n_embd, seed);
        let down = values(seed ^ 5, n_embd * n_ff, 0.5);
        let layout = NeuronLayout { n_embd, up_type: ty, down_type };
        let x = values(seed ^ 2, n_tokens * n_embd, 1.0);
        let gate = values(seed ^ 3, n_tokens * n_ff, 3.0);
        let chosen: Vec<usize> = (0..n_ff).filter(|j| (j * 31 + seed as usize) % 3 != 0).collect();
        let k = chosen.len();
        let g: Vec<f32> = (0..n_tokens * k).map(|a| gate[a / k * n_ff + chosen[a % k]]).collect();
        let keep: Vec<bool> = (0..n_tokens * k).map(|a| (a * 11 + seed as usize) % 4 != 0).collect();
        let mut outs = Vec::new();
        for threads in [1, 2] {
            let be = CpuBackend::new(threads);
            let slot_of = store_of(&be, 3, &up, &down, &layout, seed);
            let slots: Vec<u32> = chosen.iter().map(|&j| slot_of[j]).collect();
            let mut out = vec![f32::NAN; n_tokens * n_embd];
            be.neuron_mlp(NeuronMlpJob { store: 3, x: &x, n_tokens, slots: &slots, gate: &g, keep: &keep, out: &mut out }).unwrap();
            outs.push(out);
        }
        prop_assert_eq!(outs[0].iter().map(|v| v.to_bits()).collect::<Vec<_>>(), outs[1].iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        // The reference: the dense up and swiglu, then axpy_row in the order given.
        let be = CpuBackend::new(1);
        let mut dense_up = vec![0f32; n_tokens * n_ff];
        be.matmul(&x, n_tokens, &mut [MatmulJob { weight: &up, out: &mut dense_up }]).unwrap();
        let mut hidden = vec![0f32; n_tokens * n_ff];
        be.swiglu(&gate, &dense_up, &mut hidden).unwrap();
        let recs = records(&up, &down, &layout);
        let rb = layout.record_bytes();
        for t in 0..n_tokens {
            let mut acc = vec![0f32; n_embd];
            let mut exact = vec![0f64; n_embd];
            let mut magnitude = vec![0f64; n_embd];
            for (i, &j) in chosen.iter().enumerate() {
                if !keep[t * k + i] {
                    continue;
                }
                let h = hidden[t * n_ff + j];
                let column = &recs[j * rb + layout.up_bytes()..(j + 1) * rb];
                axpy_row(down_type, column, h, &mut acc).unwrap();
                for r in 0..n_embd {
                    exact[r] += f64::from(h) * f64::from(down[r * n_ff + j]);
                    // Q8_0 rounds each value by up to half a step of its block's largest.
                    let block = r / 32 * 32..(r / 32 + 1) * 32;
                    let amax = block.map(|b| down[b * n_ff + j].abs()).fold(0f32, f32::max);
                    magnitude[r] += f64::from(h.abs()) * f64::from(amax);
                }
            }
            let got = &outs[0][t * n_embd..(t + 1) * n_embd];
            for r in 0..n_embd {
                prop_assert_eq!(got[r].to_bits(), acc[r].to_bits(), "token {} column {}", t, r);
                // The down column's second rounding: half a step (block max / 127).
                let err = (f64::from(got[r]) - exact[r]).abs();
                prop_assert!(err <= magnitude[r] * 0.5 / 127.0 * 1.01 + 1e-5, "{} vs {}", got[r], exact[r]);
            }
        }
    }

    /// The vectorized Q8_0 axpy equals the scalar reference bit for bit on every level.
    #[test]
    fn axpy_q8_0_equals_the_reference_on_every_level(blocks in 1usize..9, scale in -4f32..4.0, seed in any::<u64>()) {
        let mut row = Vec::new();
        quantize_q8_0(&values(seed, blocks * 32, 2.0), &mut row);
        let base = values(seed ^ 9, blocks * 32, 1.0);
        let mut want = base.clone();
        axpy_row(GgmlType::Q8_0, &row, scale, &mut want).unwrap();
        for level in quant::available_simd_levels() {
            let mut got = base.clone();
            quant::axpy_q8_0_at(level, &row, scale, &mut got).unwrap();
            prop_assert_eq!(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "{:?}", level);
        }
        let _ = SimdLevel::Scalar;
    }
}

#[test]
fn malformed_jobs_and_writes_are_refused() {
    let be = CpuBackend::new(2);
    let layout = NeuronLayout {
        n_embd: 64,
        up_type: GgmlType::Q8_0,
        down_type: GgmlType::Q8_0,
    };
    let rb = layout.record_bytes();
    let bad_layout = NeuronLayout {
        down_type: GgmlType::Q4_0,
        ..layout
    };
    assert!(be.neuron_slots_create(1, 4, &bad_layout).is_err());
    be.neuron_slots_create(1, 4, &layout).unwrap();
    assert_eq!(be.neuron_store_bytes(), 4 * rb as u64);
    // Writes: a slot out of range, a record short, an unknown store.
    let err = be
        .neuron_slots_write(1, &[4], &vec![0; rb])
        .unwrap_err()
        .to_string();
    assert!(err.contains("slot 4"), "{err}");
    assert!(be.neuron_slots_write(1, &[0], &vec![0; rb - 1]).is_err());
    assert!(be.neuron_slots_write(2, &[0], &vec![0; rb]).is_err());
    be.neuron_slots_write(1, &[0, 3], &vec![0; 2 * rb]).unwrap();
    let x = vec![0.5f32; 64];
    let mut out = vec![f32::NAN; 64];
    let job = |store, slots: &'static [u32], gate_len, out_len| {
        (
            store,
            slots,
            vec![1.0f32; gate_len],
            vec![true; gate_len],
            out_len,
        )
    };
    for (store, slots, gate, keep, out_len) in [
        job(1, &[0, 4], 2, 64), // slot out of range
        job(1, &[0, 3], 1, 64), // gate short
        job(1, &[0, 3], 2, 63), // output short
        job(9, &[0, 3], 2, 64), // no such store
    ] {
        let mut o = vec![f32::NAN; out_len];
        let r = be.neuron_mlp(NeuronMlpJob {
            store,
            x: &x,
            n_tokens: 1,
            slots,
            gate: &gate,
            keep: &keep,
            out: &mut o,
        });
        assert!(r.is_err(), "{store} {slots:?} {out_len}");
        assert!(
            o.iter().all(|v| v.is_nan()),
            "a refused job wrote its output"
        );
    }
    // A job on zeroed records gives zeros; a freed store is gone.
    be.neuron_mlp(NeuronMlpJob {
        store: 1,
        x: &x,
        n_tokens: 1,
        slots: &[3, 0],
        gate: &[1.0, 2.0],
        keep: &[true, false],
        out: &mut out,
    })
    .unwrap();
    assert!(out.iter().all(|&v| v == 0.0));
    be.neuron_slots_free(1);
    assert_eq!(be.neuron_store_bytes(), 0);
    assert!(be.neuron_slots_write(1, &[0], &vec![0; rb]).is_err());
}
