// The parameter block every kernel takes at binding 0 (record.rs's `Params`): two
// vectors of sizes and offsets, one of floats and a third of sizes and offsets, whose
// meaning each kernel states where it reads them. Prepended to every shader by the Rust that loads it, so a kernel's
// own bindings start at 1.
struct Params {
    a: vec4<u32>,
    b: vec4<u32>,
    f: vec4<f32>,
    c: vec4<u32>,
}

@group(0) @binding(0) var<uniform> p: Params;

