//! The neuron mode in a real forward pass on tiny random models: exact at sparsity 0;
//! a cache far smaller than the layer, churning every token, gives the logits of a
//! cache that holds every neuron (no stale or missing record is ever used); a pass
//! served in parts stays close; counters add up; the order of a neuron file's records
//! changes nothing; the backend's stores go with the MLP.

use std::sync::Arc;

use ballast_runtime::ggml_type::GgmlType;
use ballast_runtime::neurons::NeuronLayout;
use ballast_runtime::store::PassId;
use ballast_runtime::{quant, Backend, CpuBackend, Model, Session};
use ballast_sparse_mlp::{
    hot_first, layer_records, MemoryNeurons, NeuronFile, NeuronFileHeader, NeuronFileWriter,
    NeuronSource, SparseFfn, NEURON_FILE_VERSION,
};
use proptest::prelude::*;

mod common;
use common::{
    calibrate, calibrate_with_predictor, run_chunked as run, text, tiny as model, tiny_on, PROMPT,
};

/// Every neuron record of `model`, in RAM.
fn records(model: &Model) -> Arc<dyn NeuronSource> {
    let (layout, layers) = layer_bytes(model);
    Arc::new(MemoryNeurons::new(layout, model.config().n_ff, layers).unwrap())
}

/// The records' layout and every layer's records of `model`, in neuron order.
fn layer_bytes(model: &Model) -> (NeuronLayout, Vec<Vec<u8>>) {
    let config = model.config();
    let mut layout = None;
    let layers = (0..config.n_layers)
        .map(|l| {
            let w = model.store().layer(PassId(0), l).unwrap();
            let up = w.matrix("ffn_up.weight").unwrap();
            let down = w.matrix("ffn_down.weight").unwrap();
            let mut values = vec![0f32; down.rows() * down.cols()];
            quant::dequantize(down.ty, down.bytes.as_slice().unwrap(), &mut values).unwrap();
            let lay = NeuronLayout {
                n_embd: config.d_model,
                up_type: up.ty,
                down_type: GgmlType::Q8_0,
            };
            layout = Some(lay);
            let mut out = Vec::new();
            layer_records(
                &lay,
                up.bytes.as_slice().unwrap(),
                &values,
                up.rows(),
                &mut out,
            )
            .unwrap();
            out
        })
        .collect();
    (layout.unwrap(), layers)
}

/// The neuron file of `model` at `path`, each layer's records in the order of `orders`.
fn neuron_file(
    model: &Model,
    path: &std::path::Path,
    orders: Vec<Vec<u32>>,
) -> Arc<dyn NeuronSource> {
    let (layout, layers) = layer_bytes(model);
    let config = model.config();
    let header = NeuronFileHeader {
        version: NEURON_FILE_VERSION,
        fingerprint: 5,
        n_layers: config.n_layers,
        n_ff: config.n_ff,
        layout,
    };
    let mut w = NeuronFileWriter::create(path, header, orders).unwrap();
    for l in &layers {
        w.write_layer(l).unwrap();
    }
    w.finish().unwrap();
    Arc::new(
        NeuronFile::open(
            path,
            5,
            config.n_layers,
            config.n_ff,
            layout.n_embd,
            layout.up_type,
        )
        .unwrap(),
    )
}

fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter()
        .map(|r| r.iter().map(|x| x.to_bits()).collect())
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4, ..ProptestConfig::default() })]

    /// At sparsity 0 the neuron mode is the dense MLP, bit for bit.
    #[test]
    fn sparsity_zero_is_dense_bit_for_bit(seed in any::<u64>()) {
        let dense = model(seed, GgmlType::Q4_1);
        let profile = calibrate(&dense, &PROMPT);
        let ffn = SparseFfn::new(profile.thresholds(0.0).unwrap()).with_neurons(records(&dense), 64, dense.backend()).unwrap();
        let stats = ffn.stats();
        let sparse = dense.share_with_ffn(Box::new(ffn));
        let (a, b) = (run(dense, &PROMPT, 6, 3), run(sparse, &PROMPT, 6, 3));
        prop_assert_eq!(bits(&a), bits(&b));
        prop_assert_eq!(stats.lock().unwrap().neuron_misses, 0);
    }

    /// Token by token at 50%, a cache of 60% of the neurons (evicting on almost every
    /// token) gives exactly the logits of one holding them all: the records it serves
    /// are always the right ones.
    #[test]
    fn a_churning_cache_serves_the_right_neurons(seed in any::<u64>(), q4 in any::<bool>()) {
        let ty = if q4 { GgmlType::Q4_1 } else { GgmlType::Q8_0 };
        let dense = model(seed, ty);
        let profile = calibrate(&dense, &text());
        let thresholds = profile.thresholds(0.5).unwrap();
        let source = records(&dense);
        let whole = SparseFfn::new(thresholds.clone()).with_neurons(source.clone(), 256, dense.backend()).unwrap();
        let small = SparseFfn::new(thresholds).with_neurons(source, 154, dense.backend()).unwrap();
        let (ws, ss) = (whole.stats(), small.stats());
        let a = run(dense.share_with_ffn(Box::new(whole)), &text()[..24], 1, 4);
        let b = run(dense.share_with_ffn(Box::new(small)), &text()[..24], 1, 4);
        let (ws, ss) = (*ws.lock().unwrap(), *ss.lock().unwrap());
        // Every pass fits the small cache in one part (else the sums are split).
        prop_assume!(ss.neuron_hits + ss.neuron_misses == ws.neuron_hits + ws.neuron_misses);
        prop_assert_eq!(bits(&a), bits(&b));
        prop_assert!(ss.neuron_misses > ws.neuron_misses, "the small cache evicted");
        prop_assert!(ws.neuron_misses <= 3 * 256, "a cache of every neuron fetches each once");
        let rb = (64 / 32 * GgmlType::Q8_0.block_bytes()) as u64 + (64 / ty.block_len() * ty.block_bytes()) as u64;
        prop_assert_eq!(ss.bytes_fetched, ss.neuron_misses * rb);
    }
}

/// Calibrated to 50%: about half the neurons skipped; the neuron mode's logits are
/// close to the row mode's (they differ by the down column's Q8_0 rounding and the sum's
/// order); a prompt served in parts (a cache smaller than the pass's union) stays close
/// to one served whole.
#[test]
fn neuron_mode_follows_the_row_mode() {
    let dense = model(3, GgmlType::Q4_1);
    let profile = calibrate(&dense, &text());
    let thresholds = profile.thresholds(0.5).unwrap();
    let source = records(&dense);
    let ffn = SparseFfn::new(thresholds.clone())
        .with_neurons(source.clone(), 256, dense.backend())
        .unwrap();
    let stats = ffn.stats();
    let neuron = run(dense.share_with_ffn(Box::new(ffn)), &text(), 48, 2);
    let s = *stats.lock().unwrap();
    assert!((s.sparsity() - 0.5).abs() < 0.05, "{}", s.sparsity());
    assert!(s.hit_rate() > 0.0 && s.hit_rate() < 1.0);
    let rows = run(
        dense.share_with_ffn(Box::new(SparseFfn::new(thresholds.clone()))),
        &text(),
        48,
        2,
    );
    let parts = SparseFfn::new(thresholds)
        .with_neurons(source, 40, dense.backend())
        .unwrap();
    let parted = run(dense.share_with_ffn(Box::new(parts)), &text(), 48, 2);
    for (other, what) in [(&rows, "row mode"), (&parted, "served in parts")] {
        for (a, b) in neuron.iter().zip(other) {
            let scale = a.iter().fold(0f32, |m, v| m.max(v.abs()));
            let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(
                diff < 0.05 * scale,
                "{what}: logits moved by {diff} (scale {scale})"
            );
        }
    }
}

/// `counting_activity` counts, per neuron, the tokens whose gate passes the layer's
/// threshold: at the thresholds of 40% about 60% of all (token, neuron) pairs, no
/// neuron above the tokens run; the hot-first order of those counts puts the busiest
/// neurons first.
#[test]
fn activity_counts_follow_the_thresholds() {
    let dense = model(11, GgmlType::Q4_1);
    let profile = calibrate(&dense, &text());
    let (ffn, calibration) = SparseFfn::counting_activity(profile.thresholds(0.4).unwrap());
    let mut session = Session::new(dense.share_with_ffn(Box::new(ffn)), 64).unwrap();
    session.feed(&text()).unwrap();
    let counts = calibration.active_counts();
    assert_eq!(counts.len(), 3);
    let tokens = text().len() as u64;
    let total: u64 = counts.iter().flatten().sum();
    let share = total as f64 / (3 * 256) as f64 / tokens as f64;
    assert!((share - 0.6).abs() < 0.05, "{share}");
    for c in &counts {
        assert_eq!(c.len(), 256);
        assert!(c.iter().all(|&n| n <= tokens));
        let order = hot_first(c);
        assert_eq!(c[order[0] as usize], *c.iter().max().unwrap());
        assert_eq!(c[order[255] as usize], *c.iter().min().unwrap());
    }
    // Without thresholds nothing is counted.
    let (ffn, calibration) = SparseFfn::counting_activity(Vec::new());
    let mut session = Session::new(dense.share_with_ffn(Box::new(ffn)), 64).unwrap();
    session.feed(&text()).unwrap();
    assert!(calibration.active_counts().is_empty());
}

/// The order a neuron file stores its records in changes nothing: at 25% (a cache of
/// 60%, evicting) the logits read from files in neuron order, hot-first order and
/// reversed order are the bits of the records in RAM, with the same bytes fetched.
#[test]
fn the_order_of_the_records_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let dense = model(5, GgmlType::Q4_1);
    let profile = calibrate(&dense, &text());
    let thresholds = profile.thresholds(0.25).unwrap();
    let (ffn, calibration) = SparseFfn::counting_activity(profile.thresholds(0.4).unwrap());
    Session::new(dense.share_with_ffn(Box::new(ffn)), 64)
        .unwrap()
        .feed(&text())
        .unwrap();
    let hot: Vec<Vec<u32>> = calibration
        .active_counts()
        .iter()
        .map(|c| hot_first(c))
        .collect();
    let identity: Vec<Vec<u32>> = vec![(0..256).collect(); 3];
    let reversed: Vec<Vec<u32>> = vec![(0..256).rev().collect(); 3];
    assert_ne!(hot, identity, "some neuron is busier than neuron 0");
    let logits = |source: Arc<dyn NeuronSource>| {
        let ffn = SparseFfn::new(thresholds.clone())
            .with_neurons(source, 154, dense.backend())
            .unwrap();
        let stats = ffn.stats();
        let out = run(dense.share_with_ffn(Box::new(ffn)), &text()[..24], 1, 4);
        let s = *stats.lock().unwrap();
        (bits(&out), s.neuron_misses)
    };
    let (want, misses) = logits(records(&dense));
    assert!(misses > 0);
    for (name, orders) in [("neuron", identity), ("hot", hot), ("reversed", reversed)] {
        let source = neuron_file(&dense, &dir.path().join(name), orders);
        assert_eq!(logits(source), (want.clone(), misses), "{name} order");
    }
}

/// Dropping the MLP frees its neuron stores on the backend (they are the cache's
/// memory); a pass on a backend other than the one it was made with is refused.
#[test]
fn dropping_the_mlp_frees_its_stores() {
    let cpu = Arc::new(CpuBackend::new(2));
    let backend: Arc<dyn Backend> = cpu.clone();
    let dense = tiny_on(7, GgmlType::Q4_1, backend.clone());
    let profile = calibrate(&dense, &text());
    let thresholds = profile.thresholds(0.5).unwrap();
    let ffn = SparseFfn::new(thresholds.clone())
        .with_neurons(records(&dense), 100, &backend)
        .unwrap();
    let mut session = Session::new(dense.share_with_ffn(Box::new(ffn)), 64).unwrap();
    session.feed(&PROMPT).unwrap();
    let record =
        (64 / 32 * GgmlType::Q4_1.block_bytes() + 64 / 32 * GgmlType::Q8_0.block_bytes()) as u64;
    assert_eq!(cpu.neuron_store_bytes(), 3 * 100 * record);
    drop(session);
    assert_eq!(cpu.neuron_store_bytes(), 0);
    // Made for another backend: refused, and nothing is created on this one.
    let other: Arc<dyn Backend> = Arc::new(CpuBackend::new(1));
    let ffn = SparseFfn::new(thresholds)
        .with_neurons(records(&dense), 100, &other)
        .unwrap();
    let mut session = Session::new(dense.share_with_ffn(Box::new(ffn)), 64).unwrap();
    let e = session.feed(&PROMPT).expect_err("refused").to_string();
    assert!(e.contains("backend it was made with"), "{e}");
    assert_eq!(cpu.neuron_store_bytes(), 0);
}

/// The prefetch (records of the neurons predicted from each layer's attention input,
/// read from the neuron file on another thread while attention runs) moves reads,
/// never results: token by token with a churning cache, the logits equal those of the
/// same cache without it, bit for bit; its counters add up.
#[test]
fn the_prefetch_changes_no_result() {
    let dense = model(21, GgmlType::Q4_1);
    let profile = calibrate_with_predictor(&dense, &text(), 16);
    let thresholds = profile.thresholds(0.5).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let in_order = vec![(0..256).collect::<Vec<u32>>(); 3];
    let source = neuron_file(&dense, &dir.path().join("m.neurons"), in_order);
    let plain = SparseFfn::new(thresholds.clone())
        .with_neurons(source.clone(), 154, dense.backend())
        .unwrap();
    let ahead = SparseFfn::new(thresholds)
        .with_neurons(source, 154, dense.backend())
        .unwrap()
        .with_prefetch(profile.attention_predictor.clone().unwrap(), 1.0)
        .unwrap();
    let (ps, ahs) = (plain.stats(), ahead.stats());
    let a = run(dense.share_with_ffn(Box::new(plain)), &text()[..24], 1, 4);
    let b = run(dense.share_with_ffn(Box::new(ahead)), &text()[..24], 1, 4);
    assert_eq!(bits(&a), bits(&b));
    let (p, s) = (*ps.lock().unwrap(), *ahs.lock().unwrap());
    assert_eq!(p.active, s.active);
    assert_eq!(p.prefetched, 0);
    assert!(s.prefetched > 0 && s.prefetch_used <= s.prefetched, "{s:?}");
    assert!(
        s.prefetch_bytes > 0 && s.bytes_fetched >= s.prefetch_bytes,
        "{s:?}"
    );
    assert!(
        s.truly_active > 0 && s.recall() > 0.0 && s.recall() <= 1.0,
        "{s:?}"
    );
    // Every active neuron the cache lacked came by the prefetch or in the MLP pass.
    assert!(s.neuron_misses < p.neuron_misses, "{s:?} against {p:?}");
}

/// Reading a fetch in parts at once (`with_readers`) gives the records of reading it
/// in one go: token by token with a churning cache served from a neuron file, the
/// logits are the same bit for bit for 1, 3 and 8 readers; a damaged record is still
/// named, whichever reader meets it.
#[test]
fn readers_at_once_change_no_result() {
    let dense = model(23, GgmlType::Q8_0);
    let profile = calibrate(&dense, &text());
    let thresholds = profile.thresholds(0.4).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.neurons");
    let source = neuron_file(&dense, &path, vec![(0..256).collect::<Vec<u32>>(); 3]);
    let logits = |readers: usize| {
        let ffn = SparseFfn::new(thresholds.clone())
            .with_neurons(source.clone(), 200, dense.backend())
            .unwrap()
            .with_readers(readers);
        let stats = ffn.stats();
        let out = run(dense.share_with_ffn(Box::new(ffn)), &text()[..12], 1, 3);
        let misses = stats.lock().unwrap().neuron_misses;
        (bits(&out), misses)
    };
    let (one, misses) = logits(1);
    assert!(misses > 3 * 200, "the cache churned: {misses} fetched");
    assert_eq!(logits(3), (one.clone(), misses));
    assert_eq!(logits(8), (one, misses));
    // A damaged record three fifths into the file: some reader of the first pass meets it.
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes.len() - 2 * (bytes.len() - 48) / 5;
    bytes[at] ^= 0x20;
    std::fs::write(&path, &bytes).unwrap();
    let config = dense.config();
    let damaged: Arc<dyn NeuronSource> = Arc::new(
        NeuronFile::open(
            &path,
            5,
            config.n_layers,
            config.n_ff,
            config.d_model,
            GgmlType::Q8_0,
        )
        .unwrap(),
    );
    // Threshold 0: the neuron path, every neuron with a nonzero gate active.
    let ffn = SparseFfn::new(vec![0.0; 3])
        .with_neurons(damaged, 256, dense.backend())
        .unwrap()
        .with_readers(8);
    let mut session = Session::new(dense.share_with_ffn(Box::new(ffn)), 64).unwrap();
    let err = session.feed(&text()[..4]).unwrap_err();
    assert!(
        err.to_string().contains("m.neurons") && err.to_string().contains("damaged"),
        "{err}"
    );
}

/// A prefetch predictor for another width of layer is refused, and so is a prefetch
/// outside the neuron mode.
#[test]
fn a_prefetch_that_cannot_serve_is_refused() {
    let dense = model(22, GgmlType::Q4_1);
    let profile = calibrate_with_predictor(&dense, &text(), 8);
    let predictor = profile.attention_predictor.clone().unwrap();
    let thresholds = profile.thresholds(0.5).unwrap();
    let err = SparseFfn::new(thresholds.clone())
        .with_prefetch(predictor.clone(), 1.0)
        .err()
        .unwrap();
    assert!(err.to_string().contains("neuron mode"), "{err}");
    let (layout, layers) = layer_bytes(&dense);
    let narrow: Vec<Vec<u8>> = layers
        .iter()
        .map(|l| l[..128 * layout.record_bytes()].to_vec())
        .collect();
    let half = Arc::new(MemoryNeurons::new(layout, 128, narrow).unwrap());
    let err = SparseFfn::new(thresholds)
        .with_neurons(half, 64, dense.backend())
        .unwrap()
        .with_prefetch(predictor, 1.0)
        .err()
        .unwrap();
    assert!(
        err.to_string()
            .contains("for 256 neurons, the records for 128"),
        "{err}"
    );
}
