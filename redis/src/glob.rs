//! Redis glob patterns (`KEYS`, `SCAN MATCH`, `CONFIG GET`, ACL key patterns), with Redis'
//! rules: `*` any run of bytes, `?` one byte, `[abc]` `[^abc]` `[a-z]` classes (a reversed
//! range is swapped, an unterminated class ends at the pattern's end), `\x` a literal `x`
//! (inside a class too), a trailing lone `\` a literal backslash. Bytes, not characters.
//!
//! Redis matches recursively and gives up past a nesting limit; here the pattern is compiled
//! into tokens that each match exactly one byte (or, for `*`, any run), and matched with one
//! backtracking point (the last `*`), which gives the same answers in O(pattern x text) time
//! and constant stack, whatever the pattern.

/// The longest pattern accepted (Redis has no limit, but a pattern is an argument and
/// arguments are bounded; this bounds what compiling one may allocate).
pub const MAX_PATTERN_BYTES: usize = 64 << 10;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Token {
    /// Any run of bytes (consecutive stars are one).
    Star,
    /// Any one byte.
    Any,
    Byte(u8),
    /// One byte in (or, negated, not in) the class.
    Class {
        negated: bool,
        items: Vec<ClassItem>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum ClassItem {
    /// From a `\x` escape: compared exactly, even without case (as Redis does).
    Escaped(u8),
    Byte(u8),
    /// Inclusive, `low <= high`.
    Range(u8, u8),
}

/// A compiled glob pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pattern {
    tokens: Vec<Token>,
    nocase: bool,
    /// The pattern is `*` (or stars only): matches everything without looking.
    matches_all: bool,
}

impl Pattern {
    /// Compiles `pattern`; `nocase` folds ASCII case as Redis' `nocase` matching does.
    /// Patterns longer than [`MAX_PATTERN_BYTES`] match nothing.
    pub fn new(pattern: &[u8], nocase: bool) -> Self {
        if pattern.len() > MAX_PATTERN_BYTES {
            return Self {
                tokens: vec![Token::Class { negated: false, items: Vec::new() }],
                nocase,
                matches_all: false,
            };
        }
        let tokens = compile(pattern);
        let matches_all = tokens.iter().all(|t| *t == Token::Star) && !tokens.is_empty();
        Self { tokens, nocase, matches_all }
    }

    /// Whether the pattern matches every string.
    pub fn matches_all(&self) -> bool {
        self.matches_all
    }

    /// Whether `text` matches the whole pattern.
    pub fn matches(&self, text: &[u8]) -> bool {
        if self.matches_all {
            return true;
        }
        let tokens = &self.tokens;
        let (mut p, mut t) = (0, 0);
        // The last star seen: the token after it, and the text position it absorbs up to.
        let mut star: Option<(usize, usize)> = None;
        while t < text.len() {
            match tokens.get(p) {
                Some(Token::Star) => {
                    p += 1;
                    star = Some((p, t));
                }
                Some(token) if self.one(token, text[t]) => {
                    p += 1;
                    t += 1;
                }
                _ => match star {
                    Some((after, absorbed)) => {
                        p = after;
                        t = absorbed + 1;
                        star = Some((after, absorbed + 1));
                    }
                    None => return false,
                },
            }
        }
        tokens[p..].iter().all(|t| *t == Token::Star)
    }

    fn one(&self, token: &Token, byte: u8) -> bool {
        let fold = |b: u8| if self.nocase { b.to_ascii_lowercase() } else { b };
        match token {
            Token::Star => unreachable!("stars are handled by the matcher"),
            Token::Any => true,
            Token::Byte(b) => fold(*b) == fold(byte),
            Token::Class { negated, items } => {
                let found = items.iter().any(|item| match *item {
                    ClassItem::Escaped(b) => b == byte,
                    ClassItem::Byte(b) => fold(b) == fold(byte),
                    ClassItem::Range(low, high) => (fold(low)..=fold(high)).contains(&fold(byte)),
                });
                found != *negated
            }
        }
    }
}

fn compile(pattern: &[u8]) -> Vec<Token> {
    let mut tokens = Vec::new();
    let mut i = 0;
    while i < pattern.len() {
        match pattern[i] {
            b'*' => {
                if tokens.last() != Some(&Token::Star) {
                    tokens.push(Token::Star);
                }
                i += 1;
            }
            b'?' => {
                tokens.push(Token::Any);
                i += 1;
            }
            b'[' => {
                let (token, next) = compile_class(pattern, i + 1);
                tokens.push(token);
                i = next;
            }
            b'\\' if i + 1 < pattern.len() => {
                tokens.push(Token::Byte(pattern[i + 1]));
                i += 2;
            }
            b => {
                tokens.push(Token::Byte(b));
                i += 1;
            }
        }
    }
    tokens
}

/// The class starting at `start` (just after `[`), and where the pattern goes on.
fn compile_class(pattern: &[u8], start: usize) -> (Token, usize) {
    let mut i = start;
    let negated = pattern.get(i) == Some(&b'^');
    if negated {
        i += 1;
    }
    let mut items = Vec::new();
    loop {
        match pattern.get(i) {
            // Unterminated: the class is what there is, and the pattern ends.
            None => return (Token::Class { negated, items }, pattern.len()),
            Some(b']') => return (Token::Class { negated, items }, i + 1),
            Some(b'\\') if i + 1 < pattern.len() => {
                items.push(ClassItem::Escaped(pattern[i + 1]));
                i += 2;
            }
            Some(&low) if i + 2 < pattern.len() && pattern[i + 1] == b'-' => {
                let high = pattern[i + 2];
                items.push(ClassItem::Range(low.min(high), low.max(high)));
                i += 3;
            }
            Some(&b) => {
                items.push(ClassItem::Byte(b));
                i += 1;
            }
        }
    }
}

/// Whether `text` matches `pattern` (compiled for this one use).
pub fn glob_match(pattern: &[u8], text: &[u8], nocase: bool) -> bool {
    Pattern::new(pattern, nocase).matches(text)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn m(pattern: &str, text: &str) -> bool {
        glob_match(pattern.as_bytes(), text.as_bytes(), false)
    }

    #[test]
    fn stars_and_question_marks() {
        assert!(m("*", ""));
        assert!(m("*", "maxclients"));
        assert!(m("max*", "maxclients"));
        assert!(m("*clients", "maxclients"));
        assert!(m("m?xc*s", "maxclients"));
        assert!(m("a*b*c", "aXbYbZc"));
        assert!(m("**a**", "a"));
        assert!(!m("sav", "save"));
        assert!(!m("*x", "save"));
        assert!(!m("", "a"));
        assert!(m("", ""));
        assert!(!m("?", ""));
    }

    #[test]
    fn classes_ranges_negation_and_escapes() {
        assert!(m("h[ae]llo", "hello"));
        assert!(!m("h[ae]llo", "hillo"));
        assert!(m("h[^e]llo", "hallo"));
        assert!(!m("h[^e]llo", "hello"));
        assert!(m("h[a-b]llo", "hbllo"));
        assert!(m("h[b-a]llo", "hallo"), "a reversed range is swapped");
        assert!(m("a\\*b", "a*b"));
        assert!(!m("a\\*b", "axb"));
        assert!(m("[\\]]", "]"));
        assert!(m("[a-]", "-") || !m("[a-]", "-"), "no panic on a dangling dash");
        assert!(m("ab\\", "ab\\"), "a trailing backslash is literal");
        assert!(m("[abc", "b"), "an unterminated class ends the pattern");
        assert!(!m("[abc", "bx"));
        assert!(m("[]", "]") || !m("[]", "]"));
    }

    #[test]
    fn nocase_folds_ascii_except_escaped_class_members() {
        assert!(glob_match(b"MAX*", b"maxclients", true));
        assert!(glob_match(b"[A-C]x", b"bX", true));
        assert!(!glob_match(b"[\\A]", b"a", true));
        assert!(!glob_match(b"MAX*", b"maxclients", false));
    }

    #[test]
    fn hostile_patterns_are_fast() {
        // Exponential for naive recursion; linear-ish here.
        let pattern = "a*".repeat(5000) + "b";
        let text = "a".repeat(20000);
        assert!(!m(&pattern, &text));
        assert!(!glob_match(&vec![b'*'; MAX_PATTERN_BYTES + 1], b"x", false), "over-long patterns match nothing");
    }

    /// A direct transcription of Redis' recursive `stringmatchlen`, as the model.
    fn redis_model(p: &[u8], s: &[u8], nocase: bool) -> bool {
        fn go(mut p: &[u8], mut s: &[u8], nocase: bool) -> bool {
            let low = |b: u8| if nocase { b.to_ascii_lowercase() } else { b };
            while !p.is_empty() && !s.is_empty() {
                match p[0] {
                    b'*' => {
                        while p.len() > 1 && p[1] == b'*' {
                            p = &p[1..];
                        }
                        if p.len() == 1 {
                            return true;
                        }
                        while !s.is_empty() {
                            if go(&p[1..], s, nocase) {
                                return true;
                            }
                            s = &s[1..];
                        }
                        return false;
                    }
                    b'?' => s = &s[1..],
                    b'[' => {
                        p = &p[1..];
                        let not = p.first() == Some(&b'^');
                        if not {
                            p = &p[1..];
                        }
                        let mut matched = false;
                        loop {
                            if p.first() == Some(&b'\\') && p.len() >= 2 {
                                p = &p[1..];
                                if p[0] == s[0] {
                                    matched = true;
                                }
                            } else if p.first() == Some(&b']') || p.is_empty() {
                                break;
                            } else if p.len() >= 3 && p[1] == b'-' {
                                let (mut a, mut b) = (p[0], p[2]);
                                if a > b {
                                    std::mem::swap(&mut a, &mut b);
                                }
                                if (low(a)..=low(b)).contains(&low(s[0])) {
                                    matched = true;
                                }
                                p = &p[2..];
                            } else if low(p[0]) == low(s[0]) {
                                matched = true;
                            }
                            p = &p[1..];
                        }
                        if p.first() == Some(&b']') {
                            p = &p[1..];
                        }
                        if matched == not {
                            return false;
                        }
                        s = &s[1..];
                        continue;
                    }
                    b'\\' if p.len() >= 2 => {
                        p = &p[1..];
                        if low(p[0]) != low(s[0]) {
                            return false;
                        }
                        s = &s[1..];
                    }
                    c => {
                        if low(c) != low(s[0]) {
                            return false;
                        }
                        s = &s[1..];
                    }
                }
                p = &p[1..];
            }
            if s.is_empty() {
                while p.first() == Some(&b'*') {
                    p = &p[1..];
                }
            }
            p.is_empty() && s.is_empty()
        }
        go(p, s, nocase)
    }

    fn alphabet() -> impl Strategy<Value = Vec<u8>> {
        proptest::collection::vec(prop::sample::select(b"ab*?[]^-\\A".to_vec()), 0..10)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4000))]
        #[test]
        fn agrees_with_redis_stringmatchlen(
            pattern in alphabet(),
            text in proptest::collection::vec(prop::sample::select(b"ab*?[]^-\\A".to_vec()), 0..8),
            nocase in any::<bool>(),
        ) {
            prop_assert_eq!(glob_match(&pattern, &text, nocase), redis_model(&pattern, &text, nocase),
                "pattern {:?} text {:?}", String::from_utf8_lossy(&pattern), String::from_utf8_lossy(&text));
        }
    }
}
