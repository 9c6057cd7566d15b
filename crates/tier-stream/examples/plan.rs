//! The planner alone: where each layer of a model would live under given budgets, and
//! the speed to expect. No model file is read: the shapes are described by their
//! dimensions (as `ballast plan --preset` does).
//!
//! Run: `cargo run -p ballast-tier-stream --example plan`

use ballast_tier_stream::{plan, Budgets, ModelShape, PlanRequest, RamTier, Speeds, Tier};

const GIB: u64 = 1 << 30;

fn main() -> Result<(), ballast_tier_stream::Error> {
    // (label, layers, hidden, heads, kv heads, MLP width, vocabulary, bits per weight)
    let llama_70b_q4_k = ("Llama-70B Q4_K", 80, 8192, 64, 8, 28672, 128256, 4.5);
    let llama_8b_q8_0 = ("Llama-8B Q8_0", 32, 4096, 32, 8, 14336, 128256, 8.5);
    let cases = [
        (
            llama_70b_q4_k,
            Budgets {
                device: Some(24 * GIB),
                ram: 48 * GIB,
            },
            "24 GiB GPU + 48 GiB RAM",
            900e9,
        ),
        (
            llama_70b_q4_k,
            Budgets {
                device: None,
                ram: 16 * GIB,
            },
            "CPU, 16 GiB RAM",
            20e9,
        ),
        (
            llama_8b_q8_0,
            Budgets {
                device: None,
                ram: 4 * GIB,
            },
            "CPU, 4 GiB RAM",
            20e9,
        ),
    ];
    for ((label, layers, hidden, heads, kv_heads, ff, vocab, bits), budgets, machine, compute) in
        cases
    {
        let shape = ModelShape::from_dims(layers, hidden, heads, kv_heads, ff, vocab, bits, 6.5625);
        let layer_gib = shape.total_layer_bytes() as f64 / GIB as f64;
        let request = PlanRequest {
            shape,
            budgets,
            ctx: 4096,
            batch: 64,
            depth: 2,
            ram_tier: RamTier::Raw,
        };
        let p = plan(&request)?;
        let map: String = p
            .tiers
            .iter()
            .map(|t| match t {
                Tier::Device => 'D',
                Tier::Ram => 'R',
                Tier::Disk => '.',
            })
            .collect();
        let (device, ram, disk) = p.counts();
        let speeds = Speeds {
            compute_bytes_per_s: compute,
            h2d_bytes_per_s: 13e9,
            disk_bytes_per_s: 3e9,
        };
        let pred = p.predict(&speeds, request.ctx);
        println!("{label} ({layer_gib:.1} GiB of layers) on {machine}, 4096-token context:");
        println!("  layers: {device} resident, {ram} streamed from RAM, {disk} streamed from disk, {} slots", p.device_slots);
        println!("  map:    {map}   (D resident, R from RAM, . from disk)");
        println!(
            "  predicted {:.2} tokens/s, bound by {}",
            pred.tokens_per_s(),
            pred.bottleneck.name()
        );
    }
    Ok(())
}
