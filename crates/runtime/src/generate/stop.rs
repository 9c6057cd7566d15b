//! Stop strings over streamed text: a stop may span tokens, and its text is never
//! sent, so text that could be the start of a stop is held back until the next token
//! tells.

/// Text released so far and text held back, for a list of stop strings.
#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    text: String,
    sent: usize,
    stopped: bool,
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings are ignored).
    pub fn new(stops: Vec<String>) -> StopMatcher {
        StopMatcher {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            text: String::new(),
            sent: 0,
            stopped: false,
        }
    }

    /// Adds generated text. Returns the text that may be sent now, and whether a stop
    /// string was found (then the text up to it is returned and nothing more must be
    /// pushed).
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        self.text.push_str(piece);
        // Held-back text is the longest tail that starts a stop, so no stop can start
        // in text already sent: searching the unsent part is enough.
        let unsent = &self.text[self.sent..];
        let found = self
            .stops
            .iter()
            .filter_map(|s| unsent.find(s.as_str()))
            .min();
        if let Some(at) = found {
            let out = unsent[..at].to_string();
            self.sent = self.text.len();
            self.stopped = true;
            return (out, true);
        }
        let hold = self.held_back();
        let end = self.text.len() - hold;
        let out = self.text[self.sent..end].to_string();
        self.sent = end;
        (out, false)
    }

    /// Whether a stop string was found.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// The text held back, released when the generation ends without a stop.
    pub fn finish(&mut self) -> String {
        let out = self.text[self.sent..].to_string();
        self.sent = self.text.len();
        out
    }

    /// Length of the longest unsent tail of the text that is a proper prefix of a stop.
    fn held_back(&self) -> usize {
        let unsent = &self.text[self.sent..];
        let mut best = 0;
        for stop in &self.stops {
            for (k, _) in stop.char_indices().skip(1) {
                if k > best && k <= unsent.len() && unsent.ends_with(&stop[..k]) {
                    best = k;
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let (t, stopped) = m.push(p);
            out.push_str(&t);
            if stopped {
                return (out, true);
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn a_stop_across_pieces_is_cut_with_its_text() {
        assert_eq!(
            run(&["END"], &["ab", "cE", "N", "Dxyz"]),
            ("abc".into(), true)
        );
        assert_eq!(run(&["\n\n"], &["a\n", "\nb"]), ("a".into(), true));
    }

    #[test]
    fn a_false_start_is_released() {
        assert_eq!(run(&["END"], &["aE", "Nb", "c"]), ("aENbc".into(), false));
        assert_eq!(run(&["END"], &["aEN"]), ("aEN".into(), false));
    }

    #[test]
    fn the_earliest_stop_wins_and_multibyte_text_is_not_split() {
        assert_eq!(run(&["cd", "b"], &["abcd"]), ("a".into(), true));
        assert_eq!(run(&["éx"], &["aé", "é", "x"]), ("aé".into(), true));
    }

    #[test]
    fn held_text_is_not_sent_early() {
        let mut m = StopMatcher::new(vec!["###".into()]);
        assert_eq!(m.push("a#"), ("a".into(), false));
        assert_eq!(m.push("#"), (String::new(), false));
        assert_eq!(m.push("b"), ("##b".into(), false));
    }
}
