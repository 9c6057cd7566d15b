// Causal grouped-query attention over the cached keys and values of one layer. One
// workgroup of 256 per (query head, token): scores of the cached tokens whose position
// is at most the query's and within its window (a masked slot, MASKED_POSITION =
// u32::MAX, is never), softmax, weighted sum of the values (the CPU backend's order per
// element). The weighted sum goes through the keys in chunks of 256 whose weights sit
// in workgroup memory, each invocation loading eight values before it adds them: one
// value at a time behind its weight's load made a real GPU wait twice per key (0.5 ms
// per layer at 1,500 keys on an H200).
//
// Keys and values are read in the type they are stored in, so a cache never has an f32
// copy: KTYPE (keys) and VTYPE (values) are 0 = f32 (one per u32), 1 = f16 (two per
// u32, the lower half first) or 2 = q8 (four int8 per u32, the lowest byte first; then,
// from word b.z for keys or b.w for values, one f16 scale per 32 elements, two per u32:
// KvRows::Q8 with the scales after the quants). Elements are counted from the start of
// the buffer, so q8 blocks are too.

// a: (n_tokens, n_heads, n_kv_heads, head_dim); b: (cached tokens, score row stride,
// first scale word of the keys, of the values); f.x: the score scale (kq_scale);
// f.y: the sliding window as the bits of a u32 (a query at position p sees keys at
// p - window + 1 ..= p; 0xffffffff: no window); c.x: the first row of q, qpos and out
// (a batched pass attends each sequence's rows over its own cache).
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> kc: array<u32>;
@group(0) @binding(3) var<storage, read> vc: array<u32>;
@group(0) @binding(4) var<storage, read> kpos: array<u32>;
@group(0) @binding(5) var<storage, read> qpos: array<u32>;
@group(0) @binding(6) var<storage, read_write> scores: array<f32>;
@group(0) @binding(7) var<storage, read_write> out: array<f32>;

override KTYPE: u32 = 0u;
override VTYPE: u32 = 0u;

// Element e of a buffer of type `ty` (0 f32, 1 f16, 2 q8: the type is also log2 of
// the elements per word) from its word and, for q8, the word holding its block's scale;
// dequantized as KvRows::read_f32 does (q * scale).
fn decode(ty: u32, word: u32, scales: u32, e: u32) -> f32 {
    switch ty {
        case 1u: {
            return unpack2x16float(word)[e & 1u];
        }
        case 2u: {
            let qv = extractBits(bitcast<i32>(word), (e & 3u) * 8u, 8u);
            return f32(qv) * unpack2x16float(scales)[(e >> 5u) & 1u];
        }
        default: {
            return bitcast<f32>(word);
        }
    }
}

// Element e of the keys, of the values. The scale word is used for q8 only (the first
// scale word is 0 for the others, so its index stays in the buffer); with the type an
// override constant, the compiler drops the unused load.
fn key(e: u32) -> f32 {
    return decode(KTYPE, kc[e >> KTYPE], kc[p.b.z + (e >> 6u)], e);
}

fn value(e: u32) -> f32 {
    return decode(VTYPE, vc[e >> VTYPE], vc[p.b.w + (e >> 6u)], e);
}

// True if the query at qp attends to the key at kp: not later (a masked slot never
// is), and within the window.
fn sees(kp: u32, qp: u32) -> bool {
    return kp <= qp && qp - kp < bitcast<u32>(p.f.y);
}

const WG: u32 = 256u;
var<workgroup> red: array<f32, 256>;
// A chunk's weights (scores times 1/sum).
var<workgroup> wsh: array<f32, 256>;

// acc plus the weights wsh[0..m] times element `at` of the values of keys first..first+m,
// in key order. Eight values are loaded before they are added, so their loads overlap.
fn add_weighted(acc_in: f32, first: u32, m: u32, at: u32, kv_dim: u32) -> f32 {
    var acc = acc_in;
    var j = 0u;
    for (; j + 8u <= m; j += 8u) {
        var v: array<f32, 8>;
        for (var u = 0u; u < 8u; u++) {
            v[u] = value((first + j + u) * kv_dim + at);
        }
        for (var u = 0u; u < 8u; u++) {
            let w = wsh[j + u];
            if (w != 0.0) {
                acc += w * v[u];
            }
        }
    }
    for (; j < m; j++) {
        let w = wsh[j];
        if (w != 0.0) {
            acc += w * value((first + j) * kv_dim + at);
        }
    }
    return acc;
}

// q·k summed in the CPU backend's order: eight lane sums, added in lane order, then the
// tail.
fn dot_cpu_order(qo: u32, ko: u32, hd: u32) -> f32 {
    var acc = array<f32, 8>(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
    let whole = hd / 8u * 8u;
    for (var d = 0u; d < whole; d += 8u) {
        for (var l = 0u; l < 8u; l++) {
            acc[l] += q[qo + d + l] * key(ko + d + l);
        }
    }
    var s = 0.0;
    for (var l = 0u; l < 8u; l++) {
        s += acc[l];
    }
    for (var d = whole; d < hd; d++) {
        s += q[qo + d] * key(ko + d);
    }
    return s;
}

fn reduce_max(lid: u32, v: f32) -> f32 {
    red[lid] = v;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
        if (lid < stride) {
            red[lid] = max(red[lid], red[lid + stride]);
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

fn reduce_sum(lid: u32, v: f32) -> f32 {
    red[lid] = v;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
        if (lid < stride) {
            red[lid] += red[lid + stride];
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

@compute @workgroup_size(256)
fn attention(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let n_heads = p.a.y;
    let hd = p.a.w;
    let h = wid.x;
    let t = wid.y;
    let row = p.c.x + t;
    let group = max(n_heads / p.a.z, 1u);
    let kvh = h / group;
    let kv_dim = p.a.z * hd;
    let qo = (row * n_heads + h) * hd;
    let sb = (t * n_heads + h) * p.b.y;
    let qp = qpos[row];
    let n = p.b.x;
    var mx = -3.0e38;
    var found = 0.0;
    for (var i = lid.x; i < n; i += WG) {
        if (sees(kpos[i], qp)) {
            var s = dot_cpu_order(qo, i * kv_dim + kvh * hd, hd) * p.f.x;
            scores[sb + i] = s;
            mx = max(mx, s);
            found = 1.0;
        }
    }
    let all_max = reduce_max(lid.x, mx);
    let any = reduce_max(lid.x, found);
    var sum = 0.0;
    for (var i = lid.x; i < n; i += WG) {
        var e = 0.0;
        if (sees(kpos[i], qp)) {
            e = exp(scores[sb + i] - all_max);
        }
        scores[sb + i] = e;
        sum += e;
    }
    let total = reduce_sum(lid.x, sum);
    storageBarrier();
    workgroupBarrier();
    let inv = select(0.0, 1.0 / total, any > 0.0);
    let vo = kvh * hd;
    for (var d0 = 0u; d0 < hd; d0 += WG) {
        let d = d0 + lid.x;
        let in_head = d < hd;
        var acc = 0.0;
        for (var c = 0u; c < n; c += WG) {
            let mine = c + lid.x;
            var wgt = 0.0;
            if (mine < n) {
                wgt = scores[sb + mine] * inv;
            }
            wsh[lid.x] = wgt;
            workgroupBarrier();
            if (in_head) {
                acc = add_weighted(acc, c, min(WG, n - c), vo + d, kv_dim);
            }
            workgroupBarrier();
        }
        if (in_head) {
            out[qo + d] = acc;
        }
    }
}

// Split attention for few queries over many keys (flash decoding): one workgroup per
// (query head, token, split of WG keys), so a decoded token's heads fill the device
// instead of one workgroup per head walking every key. Each split writes, at
// ((t * n_heads + h) * splits + s) * (head_dim + 2) of `scores`: its largest score
// (-3e38 if it sees no key), the sum of exp(score - largest), and the head_dim sums of
// those weights times the values; attention_combine.wgsl rescales them to one maximum
// and divides. c.z: the splits.
@compute @workgroup_size(256)
fn attention_split(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let n_heads = p.a.y;
    let hd = p.a.w;
    let h = wid.x;
    let t = wid.y;
    let split = wid.z;
    let row = p.c.x + t;
    let group = max(n_heads / p.a.z, 1u);
    let kvh = h / group;
    let kv_dim = p.a.z * hd;
    let qo = (row * n_heads + h) * hd;
    let qp = qpos[row];
    let n = p.b.x;
    let first = split * WG;
    let i = first + lid.x;
    var score = -3.0e38;
    var found = 0.0;
    if (i < n) {
        if (sees(kpos[i], qp)) {
            score = dot_cpu_order(qo, i * kv_dim + kvh * hd, hd) * p.f.x;
            found = 1.0;
        }
    }
    let split_max = reduce_max(lid.x, score);
    let any = reduce_max(lid.x, found);
    var e = 0.0;
    if (found > 0.0) {
        e = exp(score - split_max);
    }
    wsh[lid.x] = e;
    // Its barriers also make `wsh` visible to the whole workgroup.
    let total = reduce_sum(lid.x, e);
    let base = ((t * n_heads + h) * p.c.z + split) * (hd + 2u);
    if (lid.x == 0u) {
        scores[base] = select(-3.0e38, split_max, any > 0.0);
        scores[base + 1u] = total;
    }
    let m = min(WG, n - first);
    let vo = kvh * hd;
    for (var d = lid.x; d < hd; d += WG) {
        scores[base + 2u + d] = add_weighted(0.0, first, m, vo + d, kv_dim);
    }
}
