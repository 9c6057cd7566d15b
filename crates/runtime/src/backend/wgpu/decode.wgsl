// Decodes coded weight chunks (ballast_core::weights::CodedChunk) into a device buffer:
// one workgroup per chunk, one invocation per lane of the lane-parallel rANS stream
// (ballast-weight-codec's `rans::encode_lanes` documents the layout read here), each
// decoded byte written straight to its place in the block (the inverse of the plane
// transform), so the planes never exist on the device.
//
// p.a.x: chunks in this dispatch.
//
// A chunk's descriptor is DESC_WORDS u32 in `chunks`: stored offset (bytes into
// `stored`, a multiple of 4), stored length, raw offset (bytes into `out`), raw length,
// coding (0 raw, 1 rans-lanes), block bytes, plane count (0: symbols are the bytes in
// order), unused, then per plane (at most MAX_PLANES): offset in the block, bytes per
// block, stride, byte.
//
// Chunks may start mid-word (a block is 18 or 210 bytes) and lanes interleave their
// bytes in a block, so bytes are OR-ed into `out`, which the host clears first; each
// invocation gathers the bytes of one word before writing it.
//
// Every read is checked against the chunk's stored bytes and every loop is bounded, so
// a hostile stream cannot read outside its chunk or spin; what the decoder finds wrong
// goes to `status[chunk]` (0 good; 1 length, 2 lane or segment count, 3 a table or the
// segment lengths, 4 lane lengths, 5 a lane runs past its bytes, 6 a lane does not end
// where its encoder began, 7 a raw chunk's length), the largest code found winning.
//
// A segment's table is 256 words in workgroup memory, `cum | freq << 13` per symbol
// (a cumulative frequency reaches 4096 after the last symbol, so it needs 13 bits); a
// symbol is found by binary search over them, since a slot-to-symbol table per segment
// would not fit a workgroup's memory.

const LANES: u32 = 64u;
const PROB_BITS: u32 = 12u;
const PROB_SCALE: u32 = 4096u;
const RANS_L: u32 = 8388608u; // 1 << 23
const DESC_WORDS: u32 = 40u;
const MAX_PLANES: u32 = 8u;
const MAX_TABLES: u32 = 8u;
const NO_WORD: u32 = 0xffffffffu;

@group(0) @binding(1) var<storage, read> stored: array<u32>;
@group(0) @binding(2) var<storage, read> chunks: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<atomic<u32>>;
@group(0) @binding(4) var<storage, read_write> status: array<atomic<u32>>;

var<workgroup> tables: array<u32, 2048>; // MAX_TABLES * 256
var<workgroup> segment_len: array<u32, 8>; // MAX_TABLES
// What invocation 0 read from the header: the error found, the lane count, the
// segment count, the offset of the lane lengths.
var<workgroup> head_error: u32;
var<workgroup> head_lanes: u32;
var<workgroup> head_segments: u32;
var<workgroup> head_lengths: u32;

fn byte_at(pos: u32) -> u32 {
    return (stored[pos >> 2u] >> ((pos & 3u) * 8u)) & 0xffu;
}

// The little-endian u32 at byte `pos` (any alignment).
fn u32_at(pos: u32) -> u32 {
    return byte_at(pos) | (byte_at(pos + 1u) << 8u) | (byte_at(pos + 2u) << 16u)
        | (byte_at(pos + 3u) << 24u);
}

// Where a chunk's symbols go: symbol by symbol, the byte of the block each belongs to.
struct Placer {
    desc: u32,
    n_planes: u32,
    block_bytes: u32,
    n_blocks: u32,
    plane: u32,
    block: u32,
    k: u32,
    // Symbol index (the output offset once past the planes).
    i: u32,
    // The word being gathered and its bytes so far.
    word: u32,
    bits: u32,
    raw_offset: u32,
}

fn plane_field(pl: Placer, field: u32) -> u32 {
    return chunks[pl.desc + 8u + pl.plane * 4u + field];
}

fn placer_at(desc: u32, i: u32) -> Placer {
    var pl: Placer;
    pl.desc = desc;
    pl.raw_offset = chunks[desc + 2u];
    pl.block_bytes = max(chunks[desc + 5u], 1u);
    pl.n_planes = min(chunks[desc + 6u], MAX_PLANES);
    pl.n_blocks = chunks[desc + 3u] / pl.block_bytes;
    pl.i = i;
    pl.word = NO_WORD;
    pl.bits = 0u;
    pl.plane = pl.n_planes;
    pl.block = 0u;
    pl.k = 0u;
    var rest = i;
    for (var q = 0u; q < pl.n_planes; q++) {
        pl.plane = q;
        let size = pl.n_blocks * plane_field(pl, 1u);
        if (rest < size) {
            let per = plane_field(pl, 1u);
            pl.block = rest / per;
            pl.k = rest % per;
            return pl;
        }
        rest -= size;
    }
    pl.plane = pl.n_planes;
    return pl;
}

// Places symbol `sym` and moves to the next one.
fn place(pl: ptr<function, Placer>, sym: u32) {
    var o = (*pl).i;
    if ((*pl).plane < (*pl).n_planes) {
        let off = plane_field(*pl, 0u);
        let per = plane_field(*pl, 1u);
        let stride = plane_field(*pl, 2u);
        let byte = plane_field(*pl, 3u);
        o = (*pl).block * (*pl).block_bytes + off + (*pl).k * stride + byte;
        (*pl).k += 1u;
        if ((*pl).k == per) {
            (*pl).k = 0u;
            (*pl).block += 1u;
            if ((*pl).block == (*pl).n_blocks) {
                (*pl).block = 0u;
                (*pl).plane += 1u;
            }
        }
    }
    (*pl).i += 1u;
    let at = (*pl).raw_offset + o;
    let w = at >> 2u;
    if (w != (*pl).word) {
        flush(pl);
        (*pl).word = w;
    }
    (*pl).bits |= sym << ((at & 3u) * 8u);
}

fn flush(pl: ptr<function, Placer>) {
    if ((*pl).word != NO_WORD && (*pl).bits != 0u) {
        atomicOr(&out[(*pl).word], (*pl).bits);
    }
    (*pl).bits = 0u;
}

fn fail(chunk: u32, code: u32) {
    atomicMax(&status[chunk], code);
}

@compute @workgroup_size(64)
fn decode_chunks(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let chunk = wid.x + wid.y * nwg.x;
    if (chunk >= p.a.x) {
        return;
    }
    let desc = chunk * DESC_WORDS;
    let base = chunks[desc];
    let stored_len = chunks[desc + 1u];
    let end = base + stored_len;
    let n = chunks[desc + 3u];
    let coding = chunks[desc + 4u];

    if (coding == 0u) {
        // Raw: the symbols are the stored bytes, split among the invocations.
        if (stored_len != n) {
            if (lid == 0u) {
                fail(chunk, 7u);
            }
            return;
        }
        let per = (n + LANES - 1u) / LANES;
        let first = min(lid * per, n);
        let last = min(first + per, n);
        var pl = placer_at(desc, first);
        for (var i = first; i < last; i++) {
            place(&pl, byte_at(base + i));
        }
        flush(&pl);
        return;
    }

    if (lid == 0u) {
        var error = 0u;
        var lanes = 0u;
        var segments = 0u;
        var at = base + 12u;
        if (stored_len < 12u || u32_at(base) != n) {
            error = 1u;
        } else {
            lanes = u32_at(base + 4u);
            segments = u32_at(base + 8u);
            if (lanes == 0u || lanes > LANES || segments == 0u || segments > MAX_TABLES) {
                error = 2u;
            }
        }
        var symbols = 0u;
        for (var t = 0u; t < segments && error == 0u; t++) {
            if (at + 4u > end) {
                error = 3u;
                break;
            }
            let len = u32_at(at);
            at += 4u;
            if (len > n - symbols) {
                error = 3u;
                break;
            }
            symbols += len;
            segment_len[t] = len;
            var sum = 0u;
            for (var s = 0u; s < 256u && error == 0u; s++) {
                var v = 0u;
                var shift = 0u;
                loop {
                    if (at >= end || shift > 14u) {
                        error = 3u;
                        break;
                    }
                    let b = byte_at(at);
                    at += 1u;
                    v |= (b & 0x7fu) << shift;
                    shift += 7u;
                    if ((b & 0x80u) == 0u) {
                        break;
                    }
                }
                if (v > PROB_SCALE) {
                    error = 3u;
                }
                tables[t * 256u + s] = sum | (v << 13u);
                sum += v;
                if (sum > PROB_SCALE) {
                    error = 3u;
                }
            }
            if (error == 0u && sum != PROB_SCALE) {
                error = 3u;
            }
        }
        if (error == 0u && symbols != n) {
            error = 3u;
        }
        head_error = error;
        head_lanes = lanes;
        head_segments = segments;
        head_lengths = at;
    }
    let error = workgroupUniformLoad(&head_error);
    if (error != 0u) {
        if (lid == 0u) {
            fail(chunk, error);
        }
        return;
    }
    let lanes = workgroupUniformLoad(&head_lanes);
    let segments = head_segments;
    let lengths = head_lengths;
    if (lid >= lanes) {
        return;
    }
    // The lane's byte stream: after the lengths and states, past the earlier lanes'.
    if (lengths + 8u * lanes > end) {
        fail(chunk, 4u);
        return;
    }
    var start = lengths + 8u * lanes;
    for (var j = 0u; j < lid; j++) {
        let len = u32_at(lengths + 4u * j);
        if (len > end - start) {
            fail(chunk, 4u);
            return;
        }
        start += len;
    }
    let len = u32_at(lengths + 4u * lid);
    if (len > end - start || (lid + 1u == lanes && start + len != end)) {
        fail(chunk, 4u);
        return;
    }
    let stop = start + len;
    var x = u32_at(lengths + 4u * lanes + 4u * lid);
    if (x < RANS_L) {
        fail(chunk, 6u);
        return;
    }
    let per = (n + lanes - 1u) / lanes;
    let first = min(lid * per, n);
    let last = min(first + per, n);
    var pl = placer_at(desc, first);
    // The segment of symbol `first`, and its symbols left from there.
    var segment = 0u;
    var left = 0u;
    var seen = 0u;
    for (var t = 0u; t < segments; t++) {
        if (first < seen + segment_len[t]) {
            segment = t;
            left = seen + segment_len[t] - first;
            break;
        }
        seen += segment_len[t];
    }
    var pos = start;
    for (var i = first; i < last; i++) {
        for (var t = 0u; t < MAX_TABLES && left == 0u && segment + 1u < segments; t++) {
            segment += 1u;
            left = segment_len[segment];
        }
        left = max(left, 1u) - 1u;
        let table = segment * 256u;
        let slot = x & (PROB_SCALE - 1u);
        // The last symbol whose cumulative frequency is at most the slot (symbols of
        // frequency 0 share their successor's start).
        var lo = 0u;
        var hi = 255u;
        while (lo < hi) {
            let mid = (lo + hi + 1u) / 2u;
            if ((tables[table + mid] & 0x1fffu) <= slot) {
                lo = mid;
            } else {
                hi = mid - 1u;
            }
        }
        let entry = tables[table + lo];
        // freq <= 4096 and x >> 12 < 2^20: no overflow (the table summed to the scale).
        x = (entry >> 13u) * (x >> PROB_BITS) + slot - (entry & 0x1fffu);
        // A normalized state needs at most two bytes after a step; three bounds it.
        for (var r = 0u; r < 3u && x < RANS_L; r++) {
            if (pos >= stop) {
                fail(chunk, 5u);
                return;
            }
            x = (x << 8u) | byte_at(pos);
            pos += 1u;
        }
        place(&pl, lo);
    }
    flush(&pl);
    if (pos != stop || x != RANS_L) {
        fail(chunk, 6u);
    }
}
