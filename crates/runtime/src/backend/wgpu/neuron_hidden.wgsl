// The neuron MLP's hidden values (neurons.rs): for token t and listed neuron i, the up
// product of the neuron's record with activation row t, then silu(gate) * up, or 0 where
// the neuron is not kept. Appended to matmul.wgsl (quantized up rows, with the
// activations quantized as for `ffn_up`) or matmul_f.wgsl (float ones) and
// matmul_rows.wgsl: the record's up row is read by their `row_dot` and its lanes summed
// by `row_sum`, so `u` is the bits `matmul_rows` gives for that row, and silu.wgsl's
// `swiglu_of` the bits of the element-wise SwiGLU.
//
// `ids` (the expert ids of matmul_rows_id) is the job: k slots, then n_tokens x k gate
// values (f32 bits), then n_tokens x k keep flags (0 or 1). `out` is n_tokens x k.
// The grid is matmul_rows_id's: a workgroup of 64 computes ROWS neurons, LANES lanes each;
// workgroup z is the token. A store split into several bindings is dispatched once per
// binding; a neuron whose slot lies in another binding is left to that dispatch.
// a: (slots in this binding, n_embd, k, record stride in bytes);
// b: (first slot of this binding, n_tokens, 0, 0).
@compute @workgroup_size(64)
fn neuron_hidden(@builtin(local_invocation_id) lid: vec3<u32>,
                 @builtin(workgroup_id) wid: vec3<u32>,
                 @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = (wid.x + wid.y * nwg.x) * ROWS + lid.x / LANES;
    let t = wid.z;
    let k = p.a.z;
    var inside = false;
    var kept = false;
    var base = 0u;
    if (i < k) {
        let s = ids[i];
        inside = s >= p.b.x && s - p.b.x < p.a.x;
        kept = ids[k + p.b.y * k + t * k + i] != 0u;
        base = (s - p.b.x) * p.a.w;
    }
    var acc = 0.0;
    if (inside && kept) {
        acc = row_dot(base, t, lid.x % LANES);
    }
    let u = row_sum(lid.x, acc);
    if (lid.x % LANES == 0u && inside) {
        var h = 0.0;
        if (kept) {
            h = swiglu_of(bitcast<f32>(ids[k + t * k + i]), u);
        }
        out[t * k + i] = h;
    }
}
