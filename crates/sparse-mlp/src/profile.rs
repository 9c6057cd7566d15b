//! [`SparsityProfile`]: how the gate activations of each layer are distributed on a
//! calibration text, from which the thresholds for any target sparsity follow, and its
//! file (kept beside the model, named for it by a fingerprint, with a checksum).

use std::path::{Path, PathBuf};

use ballast_core::fingerprint::checksum;

use crate::error::{Error, Result};
use crate::predictor::{LayerPredictor, Predictor};

/// Quantile points kept per layer: the profile gives thresholds in steps of 0.5%.
pub const QUANTILES: usize = 200;

const MAGIC: &[u8; 8] = b"BLSTSPRS";
/// Version 2 appends an optional predictor, version 3 an optional attention-input
/// predictor after it; versions 1 and 2 still load.
const VERSION: u32 = 3;

/// Per layer, the quantiles of `|silu(gate(x))|` over a calibration text: entry `i` of a
/// layer is the magnitude below which a fraction `i / QUANTILES` of that layer's
/// activations fell. A target sparsity `s` then means the threshold at quantile `s`.
#[derive(Clone, Debug)]
pub struct SparsityProfile {
    /// The model's fingerprint ([`ballast_core::fingerprint::model_fingerprint`]).
    pub fingerprint: u64,
    /// MLP width (neurons per layer).
    pub n_ff: usize,
    /// Tokens the calibration ran over.
    pub tokens: u64,
    /// Per layer, `QUANTILES + 1` ascending magnitudes.
    pub layers: Vec<Vec<f32>>,
    /// The predictor fitted on the same text, if one was (`ballast sparsify --rank`).
    pub predictor: Option<Predictor>,
    /// The predictor of the same gates from each layer's attention input, fitted with
    /// it ([`crate::Calibration::fit_attention_predictor`]): what the neuron mode's
    /// prefetch uses.
    pub attention_predictor: Option<Predictor>,
}

/// True if both are absent, or both hold the same matrices and error scales.
fn same_predictor(a: &Option<Predictor>, b: &Option<Predictor>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => {
            a.layers.len() == b.layers.len()
                && a.layers.iter().zip(&b.layers).all(|(x, y)| {
                    x.project.dims == y.project.dims
                        && x.expand.dims == y.expand.dims
                        && x.project.bytes.as_slice().ok() == y.project.bytes.as_slice().ok()
                        && x.expand.bytes.as_slice().ok() == y.expand.bytes.as_slice().ok()
                        && x.sigma == y.sigma
                })
        }
        _ => false,
    }
}

impl PartialEq for SparsityProfile {
    fn eq(&self, o: &SparsityProfile) -> bool {
        self.fingerprint == o.fingerprint
            && self.n_ff == o.n_ff
            && self.tokens == o.tokens
            && self.layers == o.layers
            && same_predictor(&self.predictor, &o.predictor)
            && same_predictor(&self.attention_predictor, &o.attention_predictor)
    }
}

impl SparsityProfile {
    /// The per-layer thresholds for a target `sparsity` in [0, 1): a neuron whose
    /// `|silu(gate)|` is at most its layer's threshold is skipped. At 0 nothing is
    /// skipped (the threshold is negative) and the MLP is exact.
    pub fn thresholds(&self, sparsity: f32) -> Result<Vec<f32>> {
        if !(0.0..1.0).contains(&sparsity) {
            return Err(Error::InvalidArgument {
                what: format!("a sparsity of {sparsity}: it must be at least 0 and below 1"),
            });
        }
        if sparsity == 0.0 {
            return Ok(vec![-1.0; self.layers.len()]);
        }
        Ok(self
            .layers
            .iter()
            .map(|q| {
                let at = sparsity * QUANTILES as f32;
                let i = (at.floor() as usize).min(QUANTILES - 1);
                let frac = at - i as f32;
                q[i] + (q[i + 1] - q[i]) * frac
            })
            .collect())
    }

    /// Where a model's profile lives by default: beside it, `MODEL.sparsity`.
    pub fn path_for(model: &Path) -> PathBuf {
        let mut name = model.as_os_str().to_owned();
        name.push(".sparsity");
        PathBuf::from(name)
    }

    /// The file's bytes: magic, version `u32`, fingerprint `u64`, neurons `u32`,
    /// calibration tokens `u64`, layers `u32`, quantile points per layer `u32`, the
    /// quantiles (`f32`, layer after layer); then (version 2) the predictor's rank `u32`
    /// (0: none) and, if any, the model width `u32` and per layer its `project`
    /// (`rank × width` f16), `expand` (`neurons × rank` f16) and error scales
    /// (`neurons` f32); then (version 3) the attention-input predictor in the same
    /// form; then a checksum `u64` of all before it.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&self.fingerprint.to_le_bytes());
        b.extend_from_slice(&(self.n_ff as u32).to_le_bytes());
        b.extend_from_slice(&self.tokens.to_le_bytes());
        b.extend_from_slice(&(self.layers.len() as u32).to_le_bytes());
        b.extend_from_slice(&((QUANTILES + 1) as u32).to_le_bytes());
        for q in &self.layers {
            for v in q {
                b.extend_from_slice(&v.to_le_bytes());
            }
        }
        write_predictor(&mut b, self.predictor.as_ref());
        write_predictor(&mut b, self.attention_predictor.as_ref());
        let sum = checksum(&b);
        b.extend_from_slice(&sum.to_le_bytes());
        b
    }

    /// Reads what [`SparsityProfile::to_bytes`] wrote; `path` names the file in errors.
    /// A damaged file, another version, or quantiles that do not ascend are refused.
    pub fn from_bytes(bytes: &[u8], path: &Path) -> Result<SparsityProfile> {
        SparsityProfile::from_bytes_wanting(bytes, path, Wanted::ALL)
    }

    /// As [`SparsityProfile::from_bytes`], building only the predictors `wanted` asks
    /// for (the others are checked for their length, and left out): a predictor of a
    /// large model is tens of MB, and a run that will not use it should not hold it.
    pub fn from_bytes_wanting(
        bytes: &[u8],
        path: &Path,
        wanted: Wanted,
    ) -> Result<SparsityProfile> {
        let bad = |why: String| Error::Profile {
            path: path.to_path_buf(),
            why,
        };
        if bytes.len() < 8 + 4 + 8 + 4 + 8 + 4 + 4 + 8 || &bytes[..8] != MAGIC {
            return Err(bad("not a sparsity profile (bad magic or too short)".into()));
        }
        let (body, sum) = bytes.split_at(bytes.len() - 8);
        if checksum(body) != u64::from_le_bytes(sum.try_into().expect("8 bytes")) {
            return Err(bad(
                "checksum mismatch: the file is damaged or truncated".into()
            ));
        }
        let u32_at = |at: usize| u32::from_le_bytes(body[at..at + 4].try_into().expect("4"));
        let u64_at = |at: usize| u64::from_le_bytes(body[at..at + 8].try_into().expect("8"));
        let version = u32_at(8);
        if version == 0 || version > VERSION {
            return Err(bad(format!(
                "version {version}, this build reads versions 1 to {VERSION}"
            )));
        }
        let fingerprint = u64_at(12);
        let n_ff = u32_at(20) as usize;
        let tokens = u64_at(24);
        let n_layers = u32_at(32) as usize;
        let points = u32_at(36) as usize;
        if points != QUANTILES + 1 {
            return Err(bad(format!(
                "{points} quantile points per layer, expected {}",
                QUANTILES + 1
            )));
        }
        let quantile_bytes = n_layers
            .checked_mul(points * 4)
            .filter(|&n| n <= body.len() - 40)
            .ok_or_else(|| bad(format!("too short for {n_layers} layers of quantiles")))?;
        let data = &body[40..40 + quantile_bytes];
        let rest = &body[40 + quantile_bytes..];
        let (predictor, attention_predictor, after) = match version {
            1 => (None, None, rest),
            2 => {
                let (first, after) =
                    read_predictor(rest, n_layers, n_ff, wanted.predictor).map_err(bad)?;
                (first, None, after)
            }
            _ => {
                let (first, after) =
                    read_predictor(rest, n_layers, n_ff, wanted.predictor).map_err(bad)?;
                let (second, after) =
                    read_predictor(after, n_layers, n_ff, wanted.attention_predictor)
                        .map_err(|why| bad(format!("attention predictor: {why}")))?;
                (first, second, after)
            }
        };
        if !after.is_empty() {
            return Err(bad(format!(
                "{} bytes after the quantiles and predictors",
                after.len()
            )));
        }
        let values: Vec<f32> = data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect();
        let layers: Vec<Vec<f32>> = values.chunks(points).map(<[f32]>::to_vec).collect();
        for (l, q) in layers.iter().enumerate() {
            if q.iter().any(|v| !v.is_finite() || *v < 0.0) || q.windows(2).any(|w| w[0] > w[1]) {
                return Err(bad(format!(
                    "layer {l}'s quantiles are not ascending non-negative numbers"
                )));
            }
        }
        Ok(SparsityProfile {
            fingerprint,
            n_ff,
            tokens,
            layers,
            predictor,
            attention_predictor,
        })
    }

    /// Writes the profile to `path` atomically (a temporary file beside it, synced, then
    /// renamed over it).
    pub fn save(&self, path: &Path) -> Result<()> {
        let io = |source| Error::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        {
            use std::io::Write;
            let mut f = std::fs::File::create(&tmp).map_err(io)?;
            f.write_all(&self.to_bytes()).map_err(io)?;
            f.sync_all().map_err(io)?;
        }
        std::fs::rename(&tmp, path).map_err(io)
    }

    /// Reads the profile at `path` and checks that it was made for the model of
    /// `fingerprint` with `n_layers` layers of `n_ff` neurons.
    pub fn load(
        path: &Path,
        fingerprint: u64,
        n_layers: usize,
        n_ff: usize,
    ) -> Result<SparsityProfile> {
        SparsityProfile::load_wanting(path, fingerprint, n_layers, n_ff, Wanted::ALL)
    }

    /// As [`SparsityProfile::load`], building only the predictors `wanted` asks for.
    pub fn load_wanting(
        path: &Path,
        fingerprint: u64,
        n_layers: usize,
        n_ff: usize,
        wanted: Wanted,
    ) -> Result<SparsityProfile> {
        let bytes = std::fs::read(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let p = SparsityProfile::from_bytes_wanting(&bytes, path, wanted)?;
        drop(bytes);
        let bad = |why: String| Error::Profile {
            path: path.to_path_buf(),
            why,
        };
        if p.fingerprint != fingerprint {
            return Err(bad(
                "made for another model (its fingerprint differs); calibrate this one".into(),
            ));
        }
        if p.layers.len() != n_layers || p.n_ff != n_ff {
            return Err(bad(format!(
                "{} layers of {} neurons, the model has {n_layers} of {n_ff}",
                p.layers.len(),
                p.n_ff
            )));
        }
        Ok(p)
    }
}

/// Which predictors [`SparsityProfile::load_wanting`] builds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Wanted {
    /// The MLP-input predictor (the row mode's).
    pub predictor: bool,
    /// The attention-input predictor (the neuron mode's prefetch).
    pub attention_predictor: bool,
}

impl Wanted {
    /// Both.
    pub const ALL: Wanted = Wanted {
        predictor: true,
        attention_predictor: true,
    };
}

/// Appends a predictor section (see [`SparsityProfile::to_bytes`]): rank 0 for none.
fn write_predictor(b: &mut Vec<u8>, predictor: Option<&Predictor>) {
    let Some(p) = predictor else {
        b.extend_from_slice(&0u32.to_le_bytes());
        return;
    };
    let first = p.layers.first();
    let rank = first.map_or(0, LayerPredictor::rank);
    let width = first.map_or(0, |l| l.project.cols());
    b.extend_from_slice(&(rank as u32).to_le_bytes());
    b.extend_from_slice(&(width as u32).to_le_bytes());
    // A predictor's matrices are its own f16 buffers in memory (`LayerPredictor::new`
    // and the profile reader make them so), which cannot fail to give their bytes.
    let held = "a predictor's matrices are held in memory";
    for l in &p.layers {
        b.extend_from_slice(l.project.bytes.as_slice().expect(held));
        b.extend_from_slice(l.expand.bytes.as_slice().expect(held));
        for v in &l.sigma {
            b.extend_from_slice(&v.to_le_bytes());
        }
    }
}

/// A predictor section at the start of `bytes` (see [`SparsityProfile::to_bytes`]) and
/// the bytes after it, or why it is malformed.
fn read_predictor(
    bytes: &[u8],
    n_layers: usize,
    n_ff: usize,
    build: bool,
) -> std::result::Result<(Option<Predictor>, &[u8]), String> {
    let u32_at = |at: usize| -> std::result::Result<usize, String> {
        bytes
            .get(at..at + 4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize)
            .ok_or_else(|| "the predictor section is truncated".to_string())
    };
    let rank = u32_at(0)?;
    if rank == 0 {
        return Ok((None, &bytes[4..]));
    }
    if n_layers == 0 {
        // Nothing to predict, and no layer to say its width: it would not write back.
        return Err(format!("a predictor of rank {rank} for no layers"));
    }
    let width = u32_at(4)?;
    // u128: counts from a damaged file must not overflow.
    let per_layer =
        (rank as u128 * width as u128 + n_ff as u128 * rank as u128) * 2 + n_ff as u128 * 4;
    let needed = per_layer * n_layers as u128;
    if rank > width || ((bytes.len() - 8) as u128) < needed {
        return Err(format!(
            "a predictor of rank {rank} and width {width} for {n_layers} layers of {n_ff} neurons takes {needed} bytes, only {} remain",
            bytes.len() - 8
        ));
    }
    if !build {
        return Ok((None, &bytes[8 + needed as usize..]));
    }
    let f16s = |b: &[u8]| -> Vec<f32> {
        b.chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect()
    };
    let mut layers = Vec::with_capacity(n_layers);
    let mut at = 8;
    for l in 0..n_layers {
        let project = f16s(&bytes[at..at + rank * width * 2]);
        at += rank * width * 2;
        let expand = f16s(&bytes[at..at + n_ff * rank * 2]);
        at += n_ff * rank * 2;
        let sigma: Vec<f32> = bytes[at..at + n_ff * 4]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect();
        at += n_ff * 4;
        if project.iter().chain(&expand).any(|v| !v.is_finite())
            || sigma.iter().any(|v| !v.is_finite() || *v < 0.0)
        {
            return Err(format!(
                "layer {l}'s predictor holds values that are not finite"
            ));
        }
        layers.push(
            LayerPredictor::new(l, width, n_ff, rank, &project, &expand, sigma)
                .map_err(|e| e.to_string())?,
        );
    }
    Ok((Some(Predictor { layers }), &bytes[at..]))
}

/// A histogram of activation magnitudes on a log scale (64 bins per octave from 2^-24
/// to 2^8, and one for zero and below), from which quantiles are read to within 1.1%.
#[derive(Clone, Debug)]
pub struct MagnitudeHistogram {
    counts: Vec<u64>,
    total: u64,
}

const BINS_PER_OCTAVE: f32 = 64.0;
const LOW_EXP: f32 = -24.0;
const OCTAVES: usize = 32;

impl Default for MagnitudeHistogram {
    fn default() -> Self {
        MagnitudeHistogram {
            counts: vec![0; OCTAVES * BINS_PER_OCTAVE as usize + 1],
            total: 0,
        }
    }
}

impl MagnitudeHistogram {
    fn bin(v: f32) -> usize {
        if v.is_nan() || v <= 2f32.powf(LOW_EXP) {
            return 0;
        }
        let b = ((v.log2() - LOW_EXP) * BINS_PER_OCTAVE) as usize + 1;
        b.min(OCTAVES * BINS_PER_OCTAVE as usize)
    }

    /// The upper edge of bin `b`.
    fn edge(b: usize) -> f32 {
        if b == 0 {
            return 2f32.powf(LOW_EXP);
        }
        2f32.powf(LOW_EXP + b as f32 / BINS_PER_OCTAVE)
    }

    /// Counts the magnitudes of `values`.
    pub fn add(&mut self, values: impl IntoIterator<Item = f32>) {
        for v in values {
            self.counts[MagnitudeHistogram::bin(v.abs())] += 1;
            self.total += 1;
        }
    }

    /// Values counted.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// The `QUANTILES + 1` quantiles: point `i` is the upper edge of the first bin where
    /// the count reaches `i / QUANTILES` of the total (point 0 is 0).
    pub fn quantiles(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(QUANTILES + 1);
        out.push(0.0);
        let mut cum = 0u64;
        let mut b = 0;
        for i in 1..=QUANTILES {
            let want = (self.total as f64 * i as f64 / QUANTILES as f64).ceil() as u64;
            while b < self.counts.len() && cum + self.counts[b] < want {
                cum += self.counts[b];
                b += 1;
            }
            let b = b.min(self.counts.len() - 1);
            out.push(MagnitudeHistogram::edge(b).max(*out.last().expect("not empty")));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn profile() -> SparsityProfile {
        let mut h = MagnitudeHistogram::default();
        h.add((0..10_000).map(|i| i as f32 / 1000.0));
        SparsityProfile {
            fingerprint: 42,
            n_ff: 64,
            tokens: 100,
            layers: vec![h.quantiles(); 3],
            predictor: None,
            attention_predictor: None,
        }
    }

    /// Three layers of rank-2 predictors for a width of 4, from `seed`.
    fn predictor(seed: usize) -> Predictor {
        let layers = (0..3)
            .map(|l| {
                let project: Vec<f32> = (0..8).map(|i| (i + l + seed) as f32 * 0.25).collect();
                let expand: Vec<f32> = (0..128).map(|i| i as f32 / 64.0 - 1.0).collect();
                LayerPredictor::new(l, 4, 64, 2, &project, &expand, vec![0.5; 64]).unwrap()
            })
            .collect();
        Predictor { layers }
    }

    /// The profile with both predictors.
    fn profile_with_predictor() -> SparsityProfile {
        SparsityProfile {
            predictor: Some(predictor(0)),
            attention_predictor: Some(predictor(1)),
            ..profile()
        }
    }

    /// `profile`'s bytes as the version `version` wrote them (the sections it lacks cut
    /// off, the checksum made again).
    fn older(profile: &SparsityProfile, version: u32, cut: usize) -> Vec<u8> {
        let mut b = profile.to_bytes();
        b.truncate(b.len() - 8 - cut);
        b[8..12].copy_from_slice(&version.to_le_bytes());
        let sum = checksum(&b);
        b.extend_from_slice(&sum.to_le_bytes());
        b
    }

    #[test]
    fn predictors_round_trip_and_older_versions_still_load() {
        let p = profile_with_predictor();
        let back = SparsityProfile::from_bytes(&p.to_bytes(), Path::new("p")).unwrap();
        assert_eq!(back, p);
        assert_ne!(back, profile());
        let only_one = SparsityProfile {
            attention_predictor: None,
            ..p.clone()
        };
        assert_ne!(back, only_one);
        // Version 1: no predictor section; version 2: no attention predictor.
        let v1 = older(&profile(), 1, 8);
        assert_eq!(
            SparsityProfile::from_bytes(&v1, Path::new("p")).unwrap(),
            profile()
        );
        let v2 = older(&only_one, 2, 4);
        assert_eq!(
            SparsityProfile::from_bytes(&v2, Path::new("p")).unwrap(),
            only_one
        );
        // A version 2 file with a section after its predictor is refused.
        let v2_long = older(&p, 2, 0);
        let err = SparsityProfile::from_bytes(&v2_long, Path::new("p")).unwrap_err();
        assert!(
            err.to_string()
                .contains("after the quantiles and predictors"),
            "{err}"
        );
    }

    /// Found by the fuzz target: a predictor section for a profile of no layers parsed
    /// to a predictor that wrote back as none.
    #[test]
    fn a_predictor_for_no_layers_is_refused() {
        let empty = SparsityProfile {
            layers: Vec::new(),
            ..profile()
        };
        let mut b = empty.to_bytes();
        b.truncate(b.len() - 16);
        for v in [8u32, 4, 0] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        let sum = checksum(&b);
        b.extend_from_slice(&sum.to_le_bytes());
        let err = SparsityProfile::from_bytes(&b, Path::new("p")).unwrap_err();
        assert!(err.to_string().contains("no layers"), "{err}");
        let back = SparsityProfile::from_bytes(&empty.to_bytes(), Path::new("p")).unwrap();
        assert_eq!(back, empty);
    }

    /// A load that wants neither predictor gives the same thresholds without them, and
    /// still refuses a file whose predictor is cut short.
    #[test]
    fn predictors_not_wanted_are_left_out() {
        let p = profile_with_predictor();
        let none = Wanted {
            predictor: false,
            attention_predictor: false,
        };
        let bytes = p.to_bytes();
        let got = SparsityProfile::from_bytes_wanting(&bytes, Path::new("p"), none).unwrap();
        assert_eq!(got, profile());
        let only = Wanted {
            predictor: false,
            attention_predictor: true,
        };
        let got = SparsityProfile::from_bytes_wanting(&bytes, Path::new("p"), only).unwrap();
        assert!(got.predictor.is_none());
        assert!(same_predictor(
            &got.attention_predictor,
            &p.attention_predictor
        ));
        let short = older(&p, 3, 8);
        assert!(SparsityProfile::from_bytes_wanting(&short, Path::new("p"), none).is_err());
    }

    #[test]
    fn quantiles_follow_the_data() {
        let p = profile();
        let t = p.thresholds(0.5).unwrap();
        // Half of 0..10 lies below 5; bins are 1.1% wide.
        assert!((t[0] - 5.0).abs() < 0.1, "{t:?}");
        assert_eq!(p.thresholds(0.0).unwrap(), vec![-1.0; 3]);
        assert!(p.thresholds(1.0).is_err());
        assert!(p.thresholds(-0.1).is_err());
    }

    #[test]
    fn files_round_trip_and_refuse_another_model() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf.sparsity");
        let p = profile();
        p.save(&path).unwrap();
        assert_eq!(SparsityProfile::load(&path, 42, 3, 64).unwrap(), p);
        let err = SparsityProfile::load(&path, 43, 3, 64).unwrap_err();
        assert!(err.to_string().contains("another model"), "{err}");
        let err = SparsityProfile::load(&path, 42, 4, 64).unwrap_err();
        assert!(err.to_string().contains("3 layers"), "{err}");
    }

    proptest! {
        /// Any flipped byte or truncation is refused with an error naming the file.
        #[test]
        fn damaged_files_are_refused(at in 0usize..100_000, bit in 0u8..8, cut in 0usize..100_000, with_predictor: bool) {
            let bytes = if with_predictor { profile_with_predictor() } else { profile() }.to_bytes();
            let path = Path::new("p.sparsity");
            let mut flipped = bytes.clone();
            let at = at % bytes.len();
            flipped[at] ^= 1 << bit;
            let err = SparsityProfile::from_bytes(&flipped, path).unwrap_err();
            prop_assert!(err.to_string().contains("p.sparsity"));
            let cut = cut % bytes.len();
            prop_assert!(SparsityProfile::from_bytes(&bytes[..cut], path).is_err());
        }

        /// Arbitrary bytes never panic.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = SparsityProfile::from_bytes(&bytes, Path::new("x"));
        }
    }
}
