//! The op list a builder emits, and the host executor's errors on a graph that names
//! what is not there.

use std::sync::Arc;

use ballast_runtime::gguf::GgufFile;
use ballast_runtime::graph::{run_on_host, Graph, HostPass, Op, PassSequence, WeightRef};
use ballast_runtime::kv::{KvCache, KvPolicy};
use ballast_runtime::model::Logits;
use ballast_runtime::testing::TinyModelSpec;
use ballast_runtime::weights::LayerWeights;
use ballast_runtime::{Backend, CpuBackend, DenseFfn, DenseKv, FeedForward, Model};

fn tiny(arch: &str) -> Model {
    let spec = TinyModelSpec {
        arch: arch.into(),
        ..TinyModelSpec::default()
    };
    let file = Arc::new(GgufFile::from_bytes(spec.to_gguf_bytes().unwrap()).unwrap());
    Model::load(file, Arc::new(CpuBackend::new(1)), false).unwrap()
}

fn count(g: &Graph, f: impl Fn(&Op) -> bool) -> usize {
    g.ops().iter().filter(|op| f(op)).count()
}

struct HostMlp(DenseFfn);

impl FeedForward for HostMlp {
    fn forward(
        &mut self,
        backend: &dyn Backend,
        weights: &LayerWeights,
        x: &[f32],
        n: usize,
        out: &mut [f32],
    ) -> ballast_runtime::Result<()> {
        self.0.forward(backend, weights, x, n, out)
    }
}

struct BetweenLayers;

impl KvPolicy for BetweenLayers {
    fn before_attention(&mut self, _: usize, _: &mut dyn KvCache) -> ballast_runtime::Result<()> {
        Ok(())
    }
}

#[test]
fn the_builder_emits_one_layer_sequence_with_host_syncs_only_for_levers() {
    for arch in ["llama", "qwen2"] {
        let model = tiny(arch);
        let n_layers = model.config().n_layers;
        let g = model.pass_graph(3, Logits::Last, None);
        assert_eq!(
            count(&g, |op| matches!(op, Op::BeginLayer { .. })),
            n_layers
        );
        assert_eq!(count(&g, |op| matches!(op, Op::EndLayer)), n_layers);
        assert_eq!(g.host_syncs(), 0, "{arch}: the dense pass has no host sync");
        assert_eq!(count(&g, |op| matches!(op, Op::Attention { .. })), n_layers);
        // Per layer: q/k/v batch, output, gate/up batch, down; plus the head.
        assert_eq!(
            count(&g, |op| matches!(op, Op::Matmul { .. })),
            4 * n_layers + 1
        );
        let logits = g.logits().expect("logits wanted");
        assert_eq!(
            (g.desc(logits).rows, g.desc(logits).width),
            (1, model.config().vocab_size)
        );
        // Every layer asks for the same tensors: the scratch is reused across layers.
        let tensors = g.tensors().len();
        assert!(
            tensors < 20,
            "{arch}: {tensors} tensors for {n_layers} layers"
        );

        let lever = model.share_with_ffn(Box::new(HostMlp(DenseFfn::new())));
        let g = lever.pass_graph(3, Logits::None, Some(&BetweenLayers));
        assert_eq!(
            g.host_syncs(),
            3 * n_layers,
            "{arch}: prepare, MLP and policy per layer"
        );
        assert!(g.logits().is_none());
    }
}

/// A mixture of experts is one op per layer, not a host sync point: the router, the
/// stacked experts and qwen2moe's shared expert named by role, the expert counts from
/// the file.
#[test]
fn a_mixture_of_experts_is_one_op_per_layer_without_a_host_sync() {
    for name in ["qwen3moe", "mixtral", "qwen2moe"] {
        let spec = ballast_runtime::testing::reference_spec(name).unwrap();
        let file = Arc::new(GgufFile::from_bytes(spec.to_gguf_bytes().unwrap()).unwrap());
        let model = Model::load(file, Arc::new(CpuBackend::new(1)), false).unwrap();
        let c = model.config();
        let g = model.pass_graph(3, Logits::Last, None);
        assert_eq!(g.host_syncs(), 0, "{name}");
        let moe: Vec<&Op> = g
            .ops()
            .iter()
            .filter(|op| matches!(op, Op::Moe { .. }))
            .collect();
        assert_eq!(moe.len(), c.n_layers, "{name}");
        let Op::Moe { weights, spec, .. } = moe[0] else {
            unreachable!()
        };
        assert_eq!(Some(*spec), c.moe, "{name}");
        assert_eq!(weights.router, WeightRef::layer("ffn_gate_inp.weight"));
        assert_eq!(weights.down, WeightRef::layer("ffn_down_exps.weight"));
        assert_eq!(weights.shared.is_some(), name == "qwen2moe", "{name}");
        // Attention's q/k/v batch and output per layer, plus the head: no dense MLP.
        assert_eq!(
            count(&g, |op| matches!(op, Op::Matmul { .. })),
            2 * c.n_layers + 1,
            "{name}"
        );
        assert!(g.to_string().contains("2 of"), "{name}: {g}");
    }
}

#[test]
fn the_host_executor_names_what_a_graph_asks_for_and_is_not_there() {
    let model = tiny("llama");
    let backend = CpuBackend::new(1);
    let store = model.store();
    let run = |g: &Graph| {
        let mut kv = DenseKv::new(model.kv_shape(), 8);
        let mut ffn = DenseFfn::new();
        let mut layers = |l| store.layer(ballast_runtime::store::PassId(0), l);
        run_on_host(
            g,
            &backend,
            HostPass {
                ids: &[1],
                positions: &[0],
                globals: store.globals(),
                layers: &mut layers,
                sequences: vec![PassSequence {
                    rows: 1,
                    kv: &mut kv,
                    policy: None,
                }],
                ffn: &mut ffn,
            },
            &mut Vec::new(),
        )
        .unwrap_err()
        .to_string()
    };

    let mut g = Graph::new(1);
    let x = g.tensor("x", 1, model.config().d_model);
    let q = g.tensor("q", 1, model.config().d_model);
    let job = vec![(WeightRef::layer("attn_q.weight"), q)];
    g.push(Op::Matmul {
        x,
        jobs: job.clone(),
    });
    let err = run(&g);
    assert!(
        err.contains("attn_q.weight") && err.contains("outside"),
        "{err}"
    );

    let mut g = Graph::new(1);
    let x = g.tensor("x", 1, model.config().d_model);
    let q = g.tensor("q", 1, model.config().d_model);
    g.push(Op::BeginLayer { layer: 1 });
    g.push(Op::Matmul {
        x,
        jobs: vec![(WeightRef::layer("attn_qkv.weight"), q)],
    });
    let err = run(&g);
    assert!(err.contains("blk.1.attn_qkv.weight"), "{err}");

    let mut g = Graph::new(1);
    g.push(Op::BeginLayer { layer: 99 });
    let err = run(&g);
    assert!(err.contains("99"), "{err}");

    let mut g = Graph::new(1);
    let x = g.tensor("x", 1, 8);
    let out = g.tensor("row", 1, 8);
    g.push(Op::Rows { x, first: 3, out });
    let err = run(&g);
    assert!(err.contains("rows of x"), "{err}");

    let mut g = Graph::new(1);
    let out = g.tensor("x", 1, 8);
    g.push(Op::Embed {
        table: WeightRef::global("token_embd.bias"),
        out,
    });
    let err = run(&g);
    assert!(err.contains("token_embd.bias"), "{err}");
}

// qwen3: the per-head norm of the queries and of the keys comes after the projections
// and before RoPE, so RoPE and attention see the normed heads; llama has none.
#[test]
fn qwen3_norms_query_and_key_heads_before_rope() {
    assert_eq!(
        count(&tiny("llama").pass_graph(2, Logits::Last, None), |op| {
            matches!(op, Op::HeadRmsNorm { .. })
        }),
        0
    );
    let model = tiny("qwen3");
    let g = model.pass_graph(2, Logits::Last, None);
    let layer0: Vec<&Op> = g
        .ops()
        .iter()
        .skip_while(|op| !matches!(op, Op::BeginLayer { layer: 0 }))
        .take_while(|op| !matches!(op, Op::EndLayer))
        .collect();
    let norms: Vec<(usize, &Op)> = layer0
        .iter()
        .enumerate()
        .filter(|(_, op)| matches!(op, Op::HeadRmsNorm { .. }))
        .map(|(i, op)| (i, *op))
        .collect();
    assert_eq!(norms.len(), 2, "{g}");
    let ropes: Vec<usize> = (0..layer0.len())
        .filter(|&i| matches!(layer0[i], Op::Rope { .. }))
        .collect();
    for ((at, norm), rope) in norms.iter().zip(&ropes) {
        assert!(at < rope, "{g}");
        let (Op::HeadRmsNorm { out, head_dim, .. }, Op::Rope { x, .. }) = (norm, layer0[*rope])
        else {
            unreachable!()
        };
        assert_eq!(out, x, "RoPE rotates the normed heads");
        assert_eq!(*head_dim, model.config().head_dim);
    }
    assert!(g.to_string().contains("rms_norm per head of 16"), "{g}");
}
