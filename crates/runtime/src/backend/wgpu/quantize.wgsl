// Activation quantization as llama.cpp's x86 CPU path does it (quant::quantize_activations):
// Q8_0/Q8_1 scale by 127/amax and round half to even, d kept as f16 (and s = f16(sum*d)
// for Q8_1); Q8_K scales by -127/max (signed: the first value of the largest magnitude),
// rounds half to even, clamps at 127, keeps d = 1/iscale as f32 and the 16 block sums.
// Quantized values go four to a word into `aq` (value 4j + i in byte i of word j, two's
// complement), the layout matmul.wgsl's packed dot products read; scales into `asc` (1, 2
// or 17 floats per block).
//
// Each invocation takes four consecutive values, so a block's maximum and sums are
// reductions over workgroup memory: a Q8_K block is one workgroup of 64, a workgroup
// holds eight 32-value blocks. One invocation per block looping over it (the first
// version) left a real GPU waiting on one load after another: 55 µs per call on an H200.

// a: (n_tokens, k, 0, 0)
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> aq: array<u32>;
@group(0) @binding(3) var<storage, read_write> asc: array<f32>;

// 8 = Q8_0, 9 = Q8_1, 15 = Q8_K.
override ATYPE: u32;

var<workgroup> red_abs: array<f32, 64>;
var<workgroup> red_val: array<f32, 64>;
var<workgroup> red_idx: array<u32, 64>;
var<workgroup> red_sum: array<i32, 64>;

// f32 -> nearest f16 (ties to even) -> f32, exactly, subnormals included.
fn round_f16(v: f32) -> f32 {
    let bits = bitcast<u32>(v);
    let sign = bits & 0x80000000u;
    let a = bits & 0x7fffffffu;
    if (a < 0x38800000u) {
        let q = round(bitcast<f32>(a) * 16777216.0) * 5.9604645e-8;
        return bitcast<f32>(sign | bitcast<u32>(q));
    }
    let lsb = (a >> 13u) & 1u;
    let r = (a + 0xfffu + lsb) & 0xffffe000u;
    return bitcast<f32>(sign | r);
}

fn pack_i8(q: vec4<i32>) -> u32 {
    let b = vec4<u32>(q) & vec4<u32>(0xffu);
    return b.x | (b.y << 8u) | (b.z << 16u) | (b.w << 24u);
}

@compute @workgroup_size(64)
fn quantize(@builtin(local_invocation_id) lid3: vec3<u32>,
            @builtin(workgroup_id) wid: vec3<u32>,
            @builtin(num_workgroups) nwg: vec3<u32>) {
    let lid = lid3.x;
    let group = wid.x + wid.y * nwg.x;
    let k = p.a.y;
    if (ATYPE == 15u) {
        let nb = k / 256u;
        if (group >= p.a.x * nb) {
            return;
        }
        let base = group * 256u + 4u * lid;
        let v = vec4<f32>(x[base], x[base + 1u], x[base + 2u], x[base + 3u]);
        // The first value of the largest magnitude: its index breaks ties.
        var amax = 0.0;
        var mx = 0.0;
        var at = 0u;
        for (var j = 0u; j < 4u; j++) {
            if (abs(v[j]) > amax) {
                amax = abs(v[j]);
                mx = v[j];
                at = 4u * lid + j;
            }
        }
        red_abs[lid] = amax;
        red_val[lid] = mx;
        red_idx[lid] = at;
        workgroupBarrier();
        for (var stride = 32u; stride > 0u; stride >>= 1u) {
            if (lid < stride) {
                let o = lid + stride;
                if (red_abs[o] > red_abs[lid] || (red_abs[o] == red_abs[lid] && red_idx[o] < red_idx[lid])) {
                    red_abs[lid] = red_abs[o];
                    red_val[lid] = red_val[o];
                    red_idx[lid] = red_idx[o];
                }
            }
            workgroupBarrier();
        }
        let block_max = red_val[0];
        let zero = red_abs[0] == 0.0;
        let iscale = select(-127.0 / block_max, 0.0, zero);
        var q = vec4<i32>(0);
        if (!zero) {
            q = min(vec4<i32>(round(iscale * v)), vec4<i32>(127));
        }
        aq[base / 4u] = pack_i8(q);
        red_sum[lid] = q.x + q.y + q.z + q.w;
        workgroupBarrier();
        let sb = group * 17u;
        if ((lid & 3u) == 0u) {
            let s = red_sum[lid] + red_sum[lid + 1u] + red_sum[lid + 2u] + red_sum[lid + 3u];
            asc[sb + 1u + lid / 4u] = f32(s);
        }
        if (lid == 0u) {
            asc[sb] = select(1.0 / iscale, 0.0, zero);
        }
        return;
    }
    // Eight 32-value blocks per workgroup, eight invocations each.
    let nb = p.a.x * (k / 32u);
    let i = group * 8u + lid / 8u;
    let inside = i < nb;
    var v = vec4<f32>(0.0);
    if (inside) {
        let base = i * 32u + 4u * (lid & 7u);
        v = vec4<f32>(x[base], x[base + 1u], x[base + 2u], x[base + 3u]);
    }
    let a = abs(v);
    red_abs[lid] = max(max(a.x, a.y), max(a.z, a.w));
    workgroupBarrier();
    let first = lid & ~7u;
    var amax = 0.0;
    for (var j = 0u; j < 8u; j++) {
        amax = max(amax, red_abs[first + j]);
    }
    let d = amax / 127.0;
    let id = select(0.0, 127.0 / amax, amax != 0.0);
    let q = vec4<i32>(round(v * id));
    if (inside) {
        aq[(i * 32u + 4u * (lid & 7u)) / 4u] = pack_i8(q);
    }
    red_sum[lid] = q.x + q.y + q.z + q.w;
    workgroupBarrier();
    if (inside && (lid & 7u) == 0u) {
        var sum = 0i;
        for (var j = 0u; j < 8u; j++) {
            sum += red_sum[first + j];
        }
        if (ATYPE == 9u) {
            asc[2u * i] = round_f16(d);
            asc[2u * i + 1u] = round_f16(f32(sum) * d);
        } else {
            asc[i] = round_f16(d);
        }
    }
}
