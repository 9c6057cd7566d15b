//! What the tests of streamed models share.

use std::sync::Arc;

use ballast_runtime::model::Logits;
use ballast_runtime::DenseKv;
use ballast_runtime::{Backend, DenseFfn, Model, ModelConfig, WeightStore};
use ballast_tier_stream::{plan, Budgets, ModelShape, Plan, PlanRequest, RamTier, Tier};

/// A CPU plan for `shape` with the given tiers and `slots` slots of `slot_bytes`
/// (enough for any layer), holding RAM-tier layers as `ram_tier` says.
pub fn plan_with_tiers(
    shape: ModelShape,
    tiers: Vec<Tier>,
    slots: usize,
    slot_bytes: u64,
    ram_tier: RamTier,
) -> Plan {
    let mut p = plan(&PlanRequest {
        shape,
        budgets: Budgets {
            device: None,
            ram: 1 << 40,
        },
        ctx: 64,
        batch: 8,
        depth: slots,
        ram_tier,
    })
    .unwrap();
    p.tiers = tiers;
    p.device_slots = slots;
    p.device_slot_bytes = slot_bytes;
    p
}

/// The logits of a prefill and three decode steps (several passes through a ring of
/// slots) of the model `config` over `store`.
pub fn passes_logits(
    config: &ModelConfig,
    store: Box<dyn WeightStore>,
    backend: Arc<dyn Backend>,
) -> Vec<f32> {
    let ids = [10u32, 200, 33, 7, 99];
    let mut model = Model::from_parts(config.clone(), store, backend, Box::new(DenseFfn::new()));
    let mut kv = DenseKv::new(model.kv_shape(), 64);
    let pos: Vec<u32> = (0..ids.len() as u32).collect();
    let mut out = model
        .forward(&ids, &pos, &mut kv, None, Logits::Last)
        .unwrap()
        .to_vec();
    for step in 0..3u32 {
        let p = ids.len() as u32 + step;
        out.extend_from_slice(
            model
                .forward(&[p % 250], &[p], &mut kv, None, Logits::Last)
                .unwrap(),
        );
    }
    out
}
