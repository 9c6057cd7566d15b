// The grid both weight products share (appended to matmul.wgsl for quantized weights and
// to matmul_f.wgsl for float ones, each of which defines `row_dot`, `out`, `ids` and
// `partial`): a workgroup of 64 computes ROWS output rows, LANES lanes per row (LANES
// is set by the Rust that loads the shader: ops.rs's `MATMUL_LANES`), and workgroup z
// is the activation row (a tile of them in `matmul_rows`).

const ROWS: u32 = 64u / LANES;

// partial[at..at + LANES] added in lane order.
fn lane_sum(at: u32) -> f32 {
    var s = 0.0;
    for (var i = 0u; i < LANES; i++) {
        s += partial[at + i];
    }
    return s;
}

// The sum of the LANES lanes of each row of the workgroup, in lane order, returned to
// the row's first lane (the others get 0). Every invocation calls it (it holds a
// barrier). The neuron MLP (neuron_hidden.wgsl) sums its up products here too, so they
// are the same bits as a row of `matmul_rows`.
fn row_sum(lid: u32, acc: f32) -> f32 {
    partial[lid] = acc;
    workgroupBarrier();
    var s = 0.0;
    if (lid % LANES == 0u) {
        s = lane_sum(lid);
    }
    return s;
}

// Sums the lanes of each row of the workgroup; the first lane writes `out[at]` if
// `keep`. Every invocation calls it (it holds a barrier).
fn finish(lid: u32, keep: bool, at: u32, acc: f32) {
    let s = row_sum(lid, acc);
    if (lid % LANES == 0u && keep) {
        out[at] = s;
    }
}

// out[t][row] = dot(weight row, activation row t) for a tile of TILE tokens: workgroup
// z is the tile, so a row's weights are read once for all its tokens.
// a: (rows in this weight chunk, k, n_tokens, output row stride);
// b: (first output row of the chunk, row bytes, 0, 0).
@compute @workgroup_size(64)
fn matmul_rows(@builtin(local_invocation_id) lid: vec3<u32>,
               @builtin(workgroup_id) wid: vec3<u32>,
               @builtin(num_workgroups) nwg: vec3<u32>) {
    let row = (wid.x + wid.y * nwg.x) * ROWS + lid.x / LANES;
    let t0 = wid.z * TILE;
    let nt = min(TILE, p.a.z - t0);
    var acc: array<f32, TILE>;
    if (row < p.a.x) {
        acc = row_dot_n(row * p.b.y, t0, nt, lid.x % LANES);
    }
    for (var i = 0u; i < TILE; i++) {
        partial[64u * i + lid.x] = acc[i];
    }
    workgroupBarrier();
    // Each token's lanes in lane order, as `row_sum` adds them.
    if (lid.x % LANES == 0u && row < p.a.x) {
        for (var i = 0u; i < TILE; i++) {
            if (i < nt) {
                out[(t0 + i) * p.a.w + p.b.x + row] = lane_sum(64u * i + lid.x);
            }
        }
    }
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
    let row = (wid.x + wid.y * nwg.x) * ROWS + lid.x / LANES;
    let i = wid.z;
    let r = id_row(row, i);
    var acc = 0.0;
    if (r.x == 1u) {
        acc = row_dot(r.y * p.b.y, i / p.b.z, lid.x % LANES);
    }
    finish(lid.x, r.x == 1u, i * p.a.w + row, acc);
}
