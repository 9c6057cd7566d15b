//! [`NeuronSource`]: where a neuron's record comes from when the cache lacks it (the
//! neuron file, or records built in RAM), and the record layout of a layer.

use ballast_core::ggml_type::GgmlType;
use ballast_core::neurons::{quantize_q8_0, NeuronLayout};

use crate::{Error, Result};

/// The records of a model's MLP neurons, layer by layer ([`NeuronLayout`]: the up row as
/// the model stores it, then the down column).
pub trait NeuronSource: Send + Sync {
    /// The layout of every record.
    fn layout(&self) -> NeuronLayout;
    /// Layers.
    fn n_layers(&self) -> usize;
    /// Neurons per layer.
    fn n_ff(&self) -> usize;
    /// Appends the records of `neurons` (sorted, distinct, each below `n_ff`) of
    /// `layer` to `out`, in that order, and returns the bytes it read from where they
    /// live (a file's bytes; 0 for records already in RAM).
    fn read(&self, layer: usize, neurons: &[u32], out: &mut Vec<u8>) -> Result<u64>;
}

/// Appends the records of all `n_ff` neurons of one layer to `out`: neuron `j`'s up row
/// (row `j` of `up`, `n_ff` rows as the model stores them), then column `j` of `down`
/// (`n_embd × n_ff` f32, row-major as `ffn_down` is, dequantized) stored as
/// `layout.down_type`.
pub fn layer_records(
    layout: &NeuronLayout,
    up: &[u8],
    down: &[f32],
    n_ff: usize,
    out: &mut Vec<u8>,
) -> Result<()> {
    layout.check()?;
    let (n_embd, ub) = (layout.n_embd, layout.up_bytes());
    if up.len() != n_ff * ub || down.len() != n_embd * n_ff {
        return Err(Error::InvalidArgument {
            what: format!(
                "a layer of {n_ff} neurons of width {n_embd}: {} up bytes (want {}), {} down values (want {})",
                up.len(),
                n_ff * ub,
                down.len(),
                n_embd * n_ff
            ),
        });
    }
    let mut column = vec![0f32; n_embd];
    for (j, row) in up.chunks_exact(ub).enumerate() {
        out.extend_from_slice(row);
        for (r, c) in column.iter_mut().enumerate() {
            *c = down[r * n_ff + j];
        }
        match layout.down_type {
            GgmlType::Q8_0 => quantize_q8_0(&column, out),
            GgmlType::F16 => out.extend(
                column
                    .iter()
                    .flat_map(|&v| half::f16::from_f32(v).to_le_bytes()),
            ),
            _ => out.extend(column.iter().flat_map(|v| v.to_le_bytes())),
        }
    }
    Ok(())
}

/// Records held in RAM, one buffer per layer (tests; a model small enough to lay out
/// at load).
pub struct MemoryNeurons {
    layout: NeuronLayout,
    n_ff: usize,
    layers: Vec<Vec<u8>>,
}

impl MemoryNeurons {
    /// Records of `layers` (each [`layer_records`] of `n_ff` neurons).
    pub fn new(layout: NeuronLayout, n_ff: usize, layers: Vec<Vec<u8>>) -> Result<Self> {
        layout.check()?;
        if let Some((i, l)) = layers
            .iter()
            .enumerate()
            .find(|(_, l)| l.len() != n_ff * layout.record_bytes())
        {
            return Err(Error::InvalidArgument {
                what: format!(
                    "layer {i} holds {} bytes of records, not {} neurons of {}",
                    l.len(),
                    n_ff,
                    layout.record_bytes()
                ),
            });
        }
        Ok(MemoryNeurons {
            layout,
            n_ff,
            layers,
        })
    }
}

/// Checks a read's arguments against a source's shape.
pub(crate) fn check_read(
    layer: usize,
    neurons: &[u32],
    n_layers: usize,
    n_ff: usize,
) -> Result<()> {
    if layer >= n_layers {
        return Err(Error::InvalidArgument {
            what: format!("layer {layer} of neuron records of {n_layers} layers"),
        });
    }
    if neurons.windows(2).any(|w| w[0] >= w[1]) {
        return Err(Error::InvalidArgument {
            what: "neurons to read must be sorted and distinct".into(),
        });
    }
    if let Some(&n) = neurons.last().filter(|&&n| n as usize >= n_ff) {
        return Err(Error::InvalidArgument {
            what: format!("neuron {n} of a layer of {n_ff}"),
        });
    }
    Ok(())
}

impl NeuronSource for MemoryNeurons {
    fn layout(&self) -> NeuronLayout {
        self.layout
    }

    fn n_layers(&self) -> usize {
        self.layers.len()
    }

    fn n_ff(&self) -> usize {
        self.n_ff
    }

    fn read(&self, layer: usize, neurons: &[u32], out: &mut Vec<u8>) -> Result<u64> {
        check_read(layer, neurons, self.layers.len(), self.n_ff)?;
        let rb = self.layout.record_bytes();
        for &n in neurons {
            out.extend_from_slice(&self.layers[layer][n as usize * rb..][..rb]);
        }
        Ok(0)
    }
}
