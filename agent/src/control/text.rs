//! Text from tenants (command lines, owners), made safe to show: control characters
//! escaped, truncated without splitting a character or an escape.

/// `s` with control characters escaped ([`sanitize`]), cut to at most `n` bytes (never
/// inside an escape), with an ellipsis when cut: what is kept of a command line for logs
/// and `/state`.
pub fn truncate(s: &str, n: usize) -> String {
    let mut out = String::with_capacity(s.len().min(n) + 3);
    let mut piece = String::new();
    for c in s.chars() {
        piece.clear();
        escape_into(&mut piece, c);
        if out.len() + piece.len() > n {
            out.push('…');
            return out;
        }
        out.push_str(&piece);
    }
    out
}

/// `s` with every character that a terminal or a log reader would act on escaped: C0 and
/// C1 controls as `\n`, `\r`, `\t` or `\xHH` (ESC is `\x1b`), DEL as `\x7f`, and the
/// Unicode line separators and bidirectional overrides as `\u{HHHH}`. A tenant's command
/// line can then neither start a forged log line nor move the cursor or recolour a
/// terminal. Backslashes are kept as they are (the escaping is for display, not reversible).
pub fn sanitize(s: &str) -> std::borrow::Cow<'_, str> {
    if !s.chars().any(needs_escape) {
        return std::borrow::Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        escape_into(&mut out, c);
    }
    std::borrow::Cow::Owned(out)
}

fn needs_escape(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{2028}' | '\u{2029}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

fn escape_into(out: &mut String, c: char) {
    use std::fmt::Write;
    match c {
        '\n' => out.push_str("\\n"),
        '\r' => out.push_str("\\r"),
        '\t' => out.push_str("\\t"),
        c if c.is_control() => {
            let _ = write!(out, "\\x{:02x}", c as u32);
        }
        c if needs_escape(c) => {
            let _ = write!(out, "\\u{{{:04x}}}", c as u32);
        }
        c => out.push(c),
    }
}

#[cfg(test)]
mod text_tests {
    use super::{sanitize, truncate};

    #[test]
    fn control_characters_are_escaped() {
        let forged = "python train.py\n2024-01-01T00:00:00Z  INFO forged line";
        assert_eq!(
            sanitize(forged),
            "python train.py\\n2024-01-01T00:00:00Z  INFO forged line"
        );
        assert_eq!(
            sanitize("a\x1b[31mred\x1b[0m\r\t\x07\x7f\u{9b}2J\u{202e}z"),
            "a\\x1b[31mred\\x1b[0m\\r\\t\\x07\\x7f\\x9b2J\\u{202e}z"
        );
        assert!(matches!(
            sanitize("plain ü ✓"),
            std::borrow::Cow::Borrowed(_)
        ));
        assert!(!truncate("x\ny\u{1b}]0;title\u{7}", 200)
            .chars()
            .any(|c| c.is_control()));
    }

    #[test]
    fn truncation_never_splits_a_character_or_an_escape() {
        assert_eq!(truncate("short", 10), "short");
        assert_eq!(truncate("exactly10!", 10), "exactly10!");
        assert_eq!(truncate("0123456789abc", 10), "0123456789…");
        // 'é' is 2 bytes: it does not fit in the 1 byte left.
        assert_eq!(truncate("abcdefghié", 10), "abcdefghi…");
        // "\x1b" is 4 bytes: it is dropped whole rather than cut.
        assert_eq!(truncate("abcdefgh\x1b", 10), "abcdefgh…");
        assert_eq!(truncate("abcdef\x1b", 10), "abcdef\\x1b");
        assert_eq!(truncate("", 0), "");
    }
}
