// Writes n f32 rows (`dim` values each, from an activation buffer) into row slots of a
// keys or values buffer in its stored type (attention.wgsl's layout), rounded exactly as
// the host cache rounds them (kv-cache's rows.rs), so a row written here is the host's
// row bit for bit: f16 to nearest even, as half::f16::from_f32; q8 as quantize_block
// (scale d = amax / 127 kept as f16, quants round(x * (1 / d)) with halves away from
// zero, as Rust's f32::round, where WGSL's round goes to even). Row r goes to slot
// slots[r], in any order, so a ring that wraps or a masked cache's free slots are
// written in place; slots at or past the capacity are skipped.
//
// Float work is done on bits where WGSL lets results differ from Rust's: the f16
// conversion (lavapipe's pack2x16float rounds as half does, but WGSL leaves values past
// the f16 range indeterminate and lets a device flush f16 subnormals) and the two
// divisions (WGSL allows `/` 2.5 ULP of error, and one ULP of a scale moves quants).
// Only the product x * id is a float op (correctly rounded in WGSL). Blocks whose
// values are all subnormal f32 may still differ on a device that flushes them.
//
// A word two rows share (an f16 row of odd length; the scales of q8 rows with an odd
// number of blocks) is written a half at a time with atomics, so invocations writing
// neighbouring slots, or a slot written next to one that is not, keep each other's half.

// a: (n rows, dim, first scale word (q8), capacity in rows); b.x: the first source row
// (a batched pass writes each sequence's rows of the activations into its own cache).
@group(0) @binding(1) var<storage, read> src: array<u32>;
@group(0) @binding(2) var<storage, read> slots: array<u32>;
@group(0) @binding(3) var<storage, read_write> dst: array<atomic<u32>>;

const NONE: u32 = 0xffffffffu;

// What invocation `gid` does when each row takes `per_row` invocations: (source row,
// item of the row, slot), the slot NONE when there is nothing to do (past the last row,
// or the row's slot past the capacity).
fn job(gid: vec3<u32>, nwg: vec3<u32>, per_row: u32) -> vec3<u32> {
    let i = gid.x + gid.y * nwg.x * 64u;
    if (i >= p.a.x * per_row) {
        return vec3<u32>(0u, 0u, NONE);
    }
    let r = i / per_row;
    let slot = slots[r];
    return vec3<u32>(p.b.x + r, i % per_row, select(slot, NONE, slot >= p.a.w));
}

// Half `hi` (0: bits 0..16, 1: bits 16..32) of word `w` set to `h`, the other kept.
fn set_half(w: u32, hi: u32, h: u32) {
    let shift = hi * 16u;
    atomicAnd(&dst[w], ~(0xffffu << shift));
    atomicOr(&dst[w], (h & 0xffffu) << shift);
}

// f32 bits -> f16 bits, to nearest even: half's f32_to_f16 step by step.
fn f16_bits(x: u32) -> u32 {
    let sign = (x & 0x80000000u) >> 16u;
    let ex = x & 0x7f800000u;
    let man = x & 0x007fffffu;
    if (ex == 0x7f800000u) {
        return sign | 0x7c00u | select(0u, 0x200u, man != 0u) | (man >> 13u);
    }
    let half_exp = i32(ex >> 23u) - 112;
    if (half_exp >= 31) {
        return sign | 0x7c00u;
    }
    if (half_exp <= 0) {
        if (14 - half_exp > 24) {
            return sign;
        }
        let m = man | 0x00800000u;
        let s = u32(14 - half_exp);
        let round_bit = 1u << (s - 1u);
        let up = (m & round_bit) != 0u && (m & (3u * round_bit - 1u)) != 0u;
        return sign | ((m >> s) + select(0u, 1u, up));
    }
    let up = (man & 0x1000u) != 0u && (man & 0x2fffu) != 0u;
    return (sign | (u32(half_exp) << 10u) | (man >> 13u)) + select(0u, 1u, up);
}

// A finite x > 0 as (m, e) with x = m * 2^e and m in [2^23, 2^24).
fn split(x: f32) -> vec2<i32> {
    let bits = bitcast<u32>(x);
    let ex = i32(bits >> 23u);
    let m = bits & 0x007fffffu;
    if (ex == 0) {
        let shift = countLeadingZeros(m) - 8u;
        return vec2<i32>(i32(m << shift), -149 - i32(shift));
    }
    return vec2<i32>(i32(m | 0x00800000u), ex - 150);
}

// a / b rounded to nearest even, as IEEE division, for finite a > 0 and b > 0: long
// division of the significands, 26 quotient bits and a sticky remainder.
fn div_rn(a: f32, b: f32) -> f32 {
    let sa = split(a);
    let sb = split(b);
    var r = u32(sa.x);
    let d = u32(sb.x);
    var e = sa.y - sb.y;
    if (r < d) {
        r <<= 1u;
        e -= 1;
    }
    // r / d is in [1, 2): the quotient is qt * 2^(e - 25).
    var qt = 0u;
    for (var i = 0u; i < 26u; i++) {
        qt <<= 1u;
        if (r >= d) {
            r -= d;
            qt |= 1u;
        }
        r <<= 1u;
    }
    // Bits dropped: 2 for a normal result (24 kept), more below the normal range.
    let be = e + 127;
    let drop = u32(clamp(select(2, 3 - be, be < 1), 2, 31));
    var kept = qt >> drop;
    let guard = (qt >> (drop - 1u)) & 1u;
    let rest = (qt & ((1u << (drop - 1u)) - 1u)) != 0u || r != 0u;
    if (guard == 1u && (rest || (kept & 1u) == 1u)) {
        kept += 1u;
    }
    // A normal result's implicit bit (2^23 in `kept`) adds one to the exponent field,
    // hence be - 1; rounding up to 2^24 carries into the exponent as it should.
    let bits = select(kept, (u32(max(be, 1) - 1) << 23u) + kept, be >= 1);
    return bitcast<f32>(min(bits, 0x7f800000u));
}

// Rust's f32::round: halves away from zero. Compared, not subtracted, so no compiler
// may fuse the product into it.
fn round_away(v: f32) -> f32 {
    let a = abs(v);
    let t = trunc(a);
    return sign(v) * select(t, t + 1.0, a >= t + 0.5);
}

// One invocation per element.
@compute @workgroup_size(64)
fn kv_write_f32(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let dim = p.a.y;
    let at = job(gid, nwg, dim);
    if (at.z == NONE) {
        return;
    }
    atomicStore(&dst[at.z * dim + at.y], src[at.x * dim + at.y]);
}

// One invocation per word a row touches (dim / 2 + 1 of them; the last is idle when the
// row starts on a word).
@compute @workgroup_size(64)
fn kv_write_f16(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let dim = p.a.y;
    let at = job(gid, nwg, dim / 2u + 1u);
    if (at.z == NONE) {
        return;
    }
    let g0 = at.z * dim;
    let w = g0 / 2u + at.y;
    if (2u * w >= g0 + dim) {
        return;
    }
    let lo_in = 2u * w >= g0;
    let hi_in = 2u * w + 1u < g0 + dim;
    let s = at.x * dim + 2u * w - g0;
    if (lo_in && hi_in) {
        atomicStore(&dst[w], f16_bits(src[s]) | (f16_bits(src[s + 1u]) << 16u));
    } else if (lo_in) {
        set_half(w, 0u, f16_bits(src[s]));
    } else {
        set_half(w, 1u, f16_bits(src[s + 1u]));
    }
}

// One invocation per 32-element block (dim is a multiple of 32, so a block's quants
// are eight whole words).
@compute @workgroup_size(64)
fn kv_write_q8(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let dim = p.a.y;
    let nb = dim / 32u;
    let at = job(gid, nwg, nb);
    if (at.z == NONE) {
        return;
    }
    let r = at.x;
    let b = at.y;
    let slot = at.z;
    let base = r * dim + b * 32u;
    // The largest magnitude, compared as bits (the order of non-negative floats).
    var amax = 0u;
    for (var j = 0u; j < 32u; j++) {
        amax = max(amax, src[base + j] & 0x7fffffffu);
    }
    var d = 0.0;
    var id = 0.0;
    if (amax != 0u) {
        d = div_rn(bitcast<f32>(amax), 127.0);
        if (d != 0.0) {
            id = div_rn(1.0, d);
        }
    }
    let qw = (slot * dim + b * 32u) / 4u;
    for (var w = 0u; w < 8u; w++) {
        var word = 0u;
        for (var l = 0u; l < 4u; l++) {
            let x = bitcast<f32>(src[base + 4u * w + l]);
            // Rust's `as i8` saturates (and 0 * inf is 0 there, never NaN here).
            var q = clamp(round_away(x * id), -128.0, 127.0);
            if (x == 0.0) {
                q = 0.0;
            }
            word |= (bitcast<u32>(i32(q)) & 0xffu) << (8u * l);
        }
        atomicStore(&dst[qw + w], word);
    }
    let s = slot * nb + b;
    set_half(p.a.z + s / 2u, s & 1u, f16_bits(bitcast<u32>(d)));
}
