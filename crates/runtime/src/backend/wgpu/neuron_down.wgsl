// The neuron MLP's down sum (neurons.rs): out[t][e] = the sum over the listed neurons i,
// in the order listed, of hidden[t][i] * value e of neuron i's down column, for the
// neurons token t keeps. One invocation per (output element, token): the order is fixed,
// so the result is the same bits from run to run. WTYPE is the down column's type
// (Q8_0, F16 or F32), read through blocks.wgsl.
//
// `w` holds the records: the store itself (one binding), where neuron i's record is at
// slot job[i] times the stride, or the listed records gathered in order (a store split
// over several bindings), where it is at i times the stride. `job` is neuron_hidden's:
// k slots, n_tokens x k gate values, n_tokens x k keep flags.
// a: (k, n_embd, n_tokens, record stride in bytes);
// b: (bytes of the up row, 1 if `w` is the store else 0 (gathered), 0, 0).
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> hidden: array<f32>;
@group(0) @binding(3) var<storage, read> job: array<u32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

override WTYPE: u32;

@compute @workgroup_size(64)
fn neuron_down(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let e = gid.x + gid.y * nwg.x * 64u;
    let t = gid.z;
    let k = p.a.x;
    let n_embd = p.a.y;
    if (e >= n_embd) {
        return;
    }
    let bl = block_len();
    let at = (e / bl) * block_bytes() + p.b.x;
    let j = e % bl;
    let keep = k + p.a.z * k + t * k;
    var acc = 0.0;
    for (var i = 0u; i < k; i++) {
        if (job[keep + i] != 0u) {
            let record = select(i, job[i], p.b.y == 1u) * p.a.w;
            acc += hidden[t * k + i] * dequant(record + at, j);
        }
    }
    out[t * n_embd + e] = acc;
}
