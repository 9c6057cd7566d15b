// Greedy sampling on the device: the index of the largest logit (lowest index on ties).

// a: (n logits, first logit, 0, 0)
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> best: array<u32>;

var<workgroup> vals: array<f32, 256>;
var<workgroup> idxs: array<u32, 256>;

@compute @workgroup_size(256)
fn argmax(@builtin(local_invocation_id) lid: vec3<u32>) {
    var bv = -3.0e38;
    var bi = 0xffffffffu;
    for (var i = lid.x; i < p.a.x; i += 256u) {
        let v = logits[p.a.y + i];
        if (bi == 0xffffffffu || v > bv) {
            bv = v;
            bi = i;
        }
    }
    vals[lid.x] = bv;
    idxs[lid.x] = bi;
    workgroupBarrier();
    for (var stride = 128u; stride > 0u; stride >>= 1u) {
        if (lid.x < stride) {
            let ov = vals[lid.x + stride];
            let oi = idxs[lid.x + stride];
            let mine = idxs[lid.x];
            if (oi != 0xffffffffu && (mine == 0xffffffffu || ov > vals[lid.x] || (ov == vals[lid.x] && oi < mine))) {
                vals[lid.x] = ov;
                idxs[lid.x] = oi;
            }
        }
        workgroupBarrier();
    }
    if (lid.x == 0u) {
        best[0] = idxs[0];
    }
}
