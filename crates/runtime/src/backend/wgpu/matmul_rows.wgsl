// The grid both weight products share (appended to matmul.wgsl for quantized weights and
// to matmul_f.wgsl for float ones, each of which defines `row_dot`, `out`, `ids` and
// `partial`): a workgroup of 64 computes 8 output rows, 8 lanes per row, and
// workgroup z is the activation row.

// The sum of the 8 lanes of each row of the workgroup, in lane order, returned to the
// row's first lane (the others get 0). Every invocation calls it (it holds a barrier).
// The neuron MLP (neuron_hidden.wgsl) sums its up products here too, so they are the
// same bits as a row of `matmul_rows`.
fn row_sum(lid: u32, acc: f32) -> f32 {
    partial[lid] = acc;
    workgroupBarrier();
    var s = 0.0;
    if ((lid & 7u) == 0u) {
        for (var i = 0u; i < 8u; i++) {
            s += partial[lid + i];
        }
    }
    return s;
}

// Sums the 8 lanes of each row of the workgroup; the first lane writes `out[at]` if
// `keep`. Every invocation calls it (it holds a barrier).
fn finish(lid: u32, keep: bool, at: u32, acc: f32) {
    let s = row_sum(lid, acc);
    if ((lid & 7u) == 0u && keep) {
        out[at] = s;
    }
}

// out[t][row] = dot(weight row, activation row t).
// a: (rows in this weight chunk, k, n_tokens, output row stride);
// b: (first output row of the chunk, row bytes, 0, 0).
@compute @workgroup_size(64)
fn matmul_rows(@builtin(local_invocation_id) lid: vec3<u32>,
               @builtin(workgroup_id) wid: vec3<u32>,
               @builtin(num_workgroups) nwg: vec3<u32>) {
    let row = (wid.x + wid.y * nwg.x) * 8u + lid.x / 8u;
    let t = wid.z;
    var acc = 0.0;
    if (row < p.a.x) {
        acc = row_dot(row * p.b.y, t, lid.x & 7u);
    }
    finish(lid.x, row < p.a.x, t * p.a.w + p.b.x + row, acc);
}

// ggml's mul_mat_id: output row i (a token's choice) multiplies the rows of the expert
// `ids[i]` of a stack of experts' matrices with activation row i / b.z. Only the chosen
// experts' rows are read. A weight chunk holds some rows of the stack; a workgroup whose
// rows lie outside it writes nothing (another chunk's dispatch computes them).
// a: (rows in this weight chunk, k, output rows, rows per expert = output row stride);
// b: (first stack row of the chunk, row bytes, output rows per activation row, 0).

// Whether expert row `row` of output row `i` lies in this chunk, and its stack row.
fn id_row(row: u32, i: u32) -> vec2<u32> {
    let g = ids[i] * p.a.w + row;
    let inside = row < p.a.w && g >= p.b.x && g - p.b.x < p.a.x;
    return vec2<u32>(select(0u, 1u, inside), g - p.b.x);
}

@compute @workgroup_size(64)
fn matmul_rows_id(@builtin(local_invocation_id) lid: vec3<u32>,
                  @builtin(workgroup_id) wid: vec3<u32>,
                  @builtin(num_workgroups) nwg: vec3<u32>) {
    let row = (wid.x + wid.y * nwg.x) * 8u + lid.x / 8u;
    let i = wid.z;
    let r = id_row(row, i);
    var acc = 0.0;
    if (r.x == 1u) {
        acc = row_dot(r.y * p.b.y, i / p.b.z, lid.x & 7u);
    }
    finish(lid.x, r.x == 1u, i * p.a.w + row, acc);
}
