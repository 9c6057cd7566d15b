//! Neuron records and the backend ops that compute a SwiGLU MLP over a few of them.
//!
//! A sparse MLP that moves only the neurons a token uses (Tricksy, LLM in a Flash)
//! needs one neuron's weights in one place. In a GGUF model they are not: neuron `j`'s
//! gate and up weights are row `j` of `ffn_gate`/`ffn_up` (contiguous), but its down
//! weights are column `j` of `ffn_down`, spread over every row and sharing each
//! quantization block with 31 (or 255) other neurons. A *neuron record* puts them side
//! by side: the up row as the model stores it, then the down column, quantized along
//! the model width on its own ([`NeuronLayout::down_type`], Q8_0 by default: a second
//! rounding of weights already quantized, whose cost is measured by perplexity).
//!
//! A backend keeps records in *slots* ([`NeuronOps`]): numbered places of a store it
//! owns (device memory on a GPU, RAM on the CPU), written by [`NeuronOps::neuron_slots_write`]
//! and read by [`NeuronOps::neuron_mlp`]. Which neuron sits in which slot, what to
//! evict and what to fetch is the caller's business (the sparse-MLP lever's cache).

use crate::ggml_type::GgmlType;
use crate::Result;

/// Where one neuron's weights sit in a record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NeuronLayout {
    /// The model width: values in the up row and in the down column.
    pub n_embd: usize,
    /// The up row's type, as the model stores `ffn_up`.
    pub up_type: GgmlType,
    /// The down column's type: Q8_0, F16 or F32.
    pub down_type: GgmlType,
}

impl NeuronLayout {
    /// Bytes of `n_embd` values of `ty`, or `None` when `n_embd` is not a whole number
    /// of its blocks.
    fn span(&self, ty: GgmlType) -> Option<usize> {
        let block = ty.block_len();
        (block > 0 && self.n_embd % block == 0).then(|| self.n_embd / block * ty.block_bytes())
    }

    /// Checks that both parts are whole blocks and the down type is one records use.
    pub fn check(&self) -> Result<()> {
        let bad = |what: String| Err(crate::Error::InvalidArgument { what });
        if !matches!(
            self.down_type,
            GgmlType::Q8_0 | GgmlType::F16 | GgmlType::F32
        ) {
            return bad(format!(
                "neuron records hold the down column as Q8_0, F16 or F32, not {:?}",
                self.down_type
            ));
        }
        if self.n_embd == 0 || self.span(self.up_type).is_none() {
            return bad(format!(
                "a width of {} is not a whole number of {:?} blocks",
                self.n_embd, self.up_type
            ));
        }
        if self.span(self.down_type).is_none() {
            return bad(format!(
                "a width of {} is not a whole number of {:?} blocks",
                self.n_embd, self.down_type
            ));
        }
        Ok(())
    }

    /// Bytes of the up row.
    pub fn up_bytes(&self) -> usize {
        self.span(self.up_type).unwrap_or(0)
    }

    /// Bytes of the down column.
    pub fn down_bytes(&self) -> usize {
        self.span(self.down_type).unwrap_or(0)
    }

    /// Bytes of one record: the up row, then the down column.
    pub fn record_bytes(&self) -> usize {
        self.up_bytes() + self.down_bytes()
    }
}

/// One call of [`NeuronOps::neuron_mlp`]: the MLP of `n_tokens` tokens over `k` neurons
/// whose records sit in `slots` of store `store`.
pub struct NeuronMlpJob<'a> {
    /// The slot store ([`NeuronOps::neuron_slots_create`]).
    pub store: u64,
    /// The MLP input, `n_tokens × n_embd` (after the MLP's norm).
    pub x: &'a [f32],
    /// Tokens.
    pub n_tokens: usize,
    /// The `k` neurons' slots, in the order `gate` and `keep` list them.
    pub slots: &'a [u32],
    /// `n_tokens × k`: the gate projection of each token for each of the `k` neurons
    /// (computed by the caller, which needed it to choose them).
    pub gate: &'a [f32],
    /// `n_tokens × k`: whether token `t` uses neuron `i`; an unused one adds nothing.
    pub keep: &'a [bool],
    /// `n_tokens × n_embd`, overwritten: for each token `t`,
    /// `Σ_i keep[t,i] · silu(gate[t,i]) · (x[t] · up_i) · down_i`, summed over `i` in
    /// the order given. The up product is computed as [`crate::backend::LinearOps::matmul`]
    /// computes a row of `ffn_up` and `silu(g) · u` as [`crate::backend::ElementwiseOps::swiglu`]
    /// does, so a neuron's hidden value equals the dense MLP's; the down sum differs
    /// from the dense one by the down column's second rounding and the order.
    pub out: &'a mut [f32],
}

impl NeuronMlpJob<'_> {
    /// Checks the lengths against `layout` and a store of `capacity` slots.
    pub fn check(&self, layout: &NeuronLayout, capacity: usize) -> Result<()> {
        let k = self.slots.len();
        let shape = |what: &str, expected: usize, got: usize| {
            if expected == got {
                Ok(())
            } else {
                Err(crate::Error::ShapeMismatch {
                    what: format!("{what} of a neuron MLP"),
                    expected,
                    got,
                })
            }
        };
        shape("input", self.n_tokens * layout.n_embd, self.x.len())?;
        shape("gate values", self.n_tokens * k, self.gate.len())?;
        shape("keep mask", self.n_tokens * k, self.keep.len())?;
        shape("output", self.n_tokens * layout.n_embd, self.out.len())?;
        check_slots(self.slots, capacity)
    }
}

/// Every slot must be below `capacity`.
pub fn check_slots(slots: &[u32], capacity: usize) -> Result<()> {
    match slots.iter().find(|&&s| s as usize >= capacity) {
        Some(&s) => Err(crate::Error::InvalidArgument {
            what: format!("slot {s} of a neuron store of {capacity} slots"),
        }),
        None => Ok(()),
    }
}

/// A backend's neuron stores: numbered sets of slots holding neuron records, and the
/// SwiGLU MLP over some of them. A backend that has them offers them through
/// [`crate::Backend::neurons`]; where it says `None`, the sparse-MLP lever uses its
/// row-selected products instead.
pub trait NeuronOps: Send + Sync {
    /// Creates store `store` (replacing one of that number) with `capacity` slots for
    /// records of `layout`, their content undefined until written.
    fn neuron_slots_create(&self, store: u64, capacity: usize, layout: &NeuronLayout)
        -> Result<()>;
    /// Writes `records` (`slots.len()` records, one after another) into `slots` of
    /// `store`. On a device this is the upload a cache miss costs, and it is counted as
    /// uploaded bytes.
    fn neuron_slots_write(&self, store: u64, slots: &[u32], records: &[u8]) -> Result<()>;
    /// Frees store `store` (nothing if there is none).
    fn neuron_slots_free(&self, store: u64);
    /// The SwiGLU MLP over the neurons in `job.slots` ([`NeuronMlpJob`]).
    fn neuron_mlp(&self, job: NeuronMlpJob<'_>) -> Result<()>;
}

/// `values` (a multiple of 32) quantized to Q8_0 as ggml's reference quantizer does:
/// per block of 32, `d = max|v| / 127` stored as f16, `q = round(v / d)`.
pub fn quantize_q8_0(values: &[f32], out: &mut Vec<u8>) {
    for block in values.chunks(32) {
        let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&half::f16::from_f32(d).to_le_bytes());
        out.extend(block.iter().map(|&v| (v * id).round() as i8 as u8));
        // A short last block (never, for a whole number of blocks) is padded with 0.
        out.extend(std::iter::repeat_n(0u8, 32 - block.len()));
    }
}

/// Adds `scale · row` to `acc` for a down column `row` of `ty` (Q8_0, F16 or F32) and
/// `acc.len()` values: the reference for [`NeuronOps::neuron_mlp`]'s down sum.
pub fn axpy_row(ty: GgmlType, row: &[u8], scale: f32, acc: &mut [f32]) -> Result<()> {
    match ty {
        GgmlType::Q8_0 => {
            for (block, a) in row.chunks_exact(34).zip(acc.chunks_mut(32)) {
                let d = half::f16::from_le_bytes([block[0], block[1]]).to_f32() * scale;
                for (q, v) in block[2..].iter().zip(a) {
                    *v += d * f32::from(*q as i8);
                }
            }
        }
        GgmlType::F16 => {
            for (h, v) in row.chunks_exact(2).zip(acc) {
                *v += scale * half::f16::from_le_bytes([h[0], h[1]]).to_f32();
            }
        }
        GgmlType::F32 => {
            for (f, v) in row.chunks_exact(4).zip(acc) {
                *v += scale * f32::from_le_bytes(f.try_into().expect("4 bytes"));
            }
        }
        ty => {
            return Err(crate::Error::QuantUnsupported {
                ty,
                op: "a neuron record's down column",
            })
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_sizes_and_checks() {
        let l = NeuronLayout {
            n_embd: 64,
            up_type: GgmlType::Q4_1,
            down_type: GgmlType::Q8_0,
        };
        l.check().unwrap();
        assert_eq!(
            (l.up_bytes(), l.down_bytes(), l.record_bytes()),
            (40, 68, 108)
        );
        let bad = NeuronLayout {
            down_type: GgmlType::Q4_0,
            ..l
        };
        assert!(bad.check().unwrap_err().to_string().contains("Q4_0"));
        let odd = NeuronLayout { n_embd: 48, ..l };
        assert!(odd.check().unwrap_err().to_string().contains("48"));
    }

    #[test]
    fn q8_0_round_trip_is_within_half_a_step() {
        let values: Vec<f32> = (0..64).map(|i| ((i * 37) % 23) as f32 - 11.3).collect();
        let mut q = Vec::new();
        quantize_q8_0(&values, &mut q);
        assert_eq!(q.len(), 68);
        let mut back = vec![0f32; 64];
        axpy_row(GgmlType::Q8_0, &q, 1.0, &mut back).unwrap();
        for (block, got) in values.chunks(32).zip(back.chunks(32)) {
            let step = block.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
            for (v, g) in block.iter().zip(got) {
                assert!((v - g).abs() <= step * 0.5 + step * 1e-3, "{v} vs {g}");
            }
        }
    }
}
