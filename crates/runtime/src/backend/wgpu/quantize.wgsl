// Activation quantization as llama.cpp's x86 CPU path does it (quant::quantize_activations):
// Q8_0/Q8_1 scale by 127/amax and round half to even, d kept as f16 (and s = f16(sum*d)
// for Q8_1); Q8_K scales by -127/max (signed), rounds half to even, clamps at 127, keeps
// d = 1/iscale as f32 and the 16 block sums. One invocation per block; quantized values
// go one per i32 into `aq`, scales into `asc` (1, 2 or 17 floats per block).

// a: (n_tokens, k, 0, 0)
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> aq: array<i32>;
@group(0) @binding(3) var<storage, read_write> asc: array<f32>;

// 8 = Q8_0, 9 = Q8_1, 15 = Q8_K.
override ATYPE: u32;

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

@compute @workgroup_size(64)
fn quantize(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let bl = select(32u, 256u, ATYPE == 15u);
    let nb = p.a.y / bl;
    let i = gid.x + gid.y * nwg.x * 64u;
    if (i >= p.a.x * nb) {
        return;
    }
    let base = i * bl;
    if (ATYPE == 15u) {
        var amax = 0.0;
        var mx = 0.0;
        for (var j = 0u; j < 256u; j++) {
            let v = x[base + j];
            if (abs(v) > amax) {
                amax = abs(v);
                mx = v;
            }
        }
        let sb = i * 17u;
        if (amax == 0.0) {
            for (var j = 0u; j < 256u; j++) {
                aq[base + j] = 0;
            }
            for (var g = 0u; g < 17u; g++) {
                asc[sb + g] = 0.0;
            }
            return;
        }
        let iscale = -127.0 / mx;
        for (var g = 0u; g < 16u; g++) {
            var s = 0i;
            for (var j = 0u; j < 16u; j++) {
                let q = min(i32(round(iscale * x[base + 16u * g + j])), 127);
                aq[base + 16u * g + j] = q;
                s += q;
            }
            asc[sb + 1u + g] = f32(s);
        }
        asc[sb] = 1.0 / iscale;
        return;
    }
    var amax = 0.0;
    for (var j = 0u; j < 32u; j++) {
        amax = max(amax, abs(x[base + j]));
    }
    let d = amax / 127.0;
    let id = select(0.0, 127.0 / amax, amax != 0.0);
    var sum = 0i;
    for (var j = 0u; j < 32u; j++) {
        let q = i32(round(x[base + j] * id));
        aq[base + j] = q;
        sum += q;
    }
    if (ATYPE == 9u) {
        asc[2u * i] = round_f16(d);
        asc[2u * i + 1u] = round_f16(f32(sum) * d);
    } else {
        asc[i] = round_f16(d);
    }
}
