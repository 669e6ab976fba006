//! The one redaction of secrets in URLs, for every message and log line of the package: the Rust
//! core's errors, and (through `fastload._core.redact_urls`) every `fastload.FastloadError` and
//! every record of the `fastload` logger.
//!
//! Two parts of a URL carry secrets: its query (a presigned `X-Amz-Signature`, an Azure SAS
//! `sig=`) and its user-info (`http://user:PASSWORD@host/`, `s3://KEY:SECRET@bucket/`). Both are
//! replaced by a placeholder wherever a URL (`scheme://...`) appears in a text; the rest of the
//! text is kept as it is.

/// What a URL's query becomes.
pub const QUERY_HIDDEN: &str = "?<query hidden>";
/// What a URL's user-info becomes.
pub const CREDENTIALS_HIDDEN: &str = "<credentials hidden>@";

/// Whether `c` ends a URL written in a message (whitespace, or what quotes or brackets it).
fn ends_url(c: char) -> bool {
    c.is_whitespace() || matches!(c, ')' | '"' | '\'' | '>' | ']' | '`' | ',')
}

/// Whether the characters before `://` at `at` in `text` are a scheme (`s3`, `https`,
/// `abfss`, `git+ssh`): a letter then letters, digits, `+`, `-` or `.`.
fn scheme_before(text: &str, at: usize) -> bool {
    let head = &text[..at];
    let start = head
        .rfind(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.')))
        .map_or(0, |i| i + 1);
    head[start..]
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic())
}

/// The user-info of `rest` (a URL less its `scheme://`) ends where: the last `@` before the end
/// of its authority (the first `/`, `?` or `#`), or, where the text before an `@` has a `:`
/// (`KEY:SECRET/with/slashes@bucket`: a secret key may hold `/`), that `@`. `None` without one.
fn user_info_end(rest: &str) -> Option<usize> {
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    if let Some(at) = rest[..authority_end].rfind('@') {
        return Some(at);
    }
    let query = rest.find(['?', '#']).unwrap_or(rest.len());
    let at = rest[..query].find('@')?;
    rest[..at].contains(':').then_some(at)
}

/// `text` with the query and the user-info of every URL in it replaced by placeholders
/// ([`QUERY_HIDDEN`], [`CREDENTIALS_HIDDEN`]); everything else unchanged.
pub fn urls(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let is_url = scheme_before(rest, at);
        let (head, tail) = rest.split_at(at + 3);
        out.push_str(head);
        if !is_url {
            rest = tail;
            continue;
        }
        let end = tail.find(ends_url).unwrap_or(tail.len());
        // "URL: message": punctuation after a URL is the sentence's, not the URL's
        let end = tail[..end].trim_end_matches([':', ';', '.']).len();
        let mut url = &tail[..end];
        if let Some(user) = user_info_end(url) {
            out.push_str(CREDENTIALS_HIDDEN);
            url = &url[user + 1..];
        }
        match url.find('?') {
            Some(q) => {
                out.push_str(&url[..q]);
                out.push_str(QUERY_HIDDEN);
            }
            None => out.push_str(url),
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

/// [`urls`], on one line (runs of whitespace become one space), at most 600 characters: for the
/// detail of an error that another library wrote.
pub fn one_line(text: &str) -> String {
    let one_line = urls(text).split_whitespace().collect::<Vec<_>>().join(" ");
    let one_line = one_line.trim_end_matches([':', ' ']).to_string();
    if one_line.chars().count() > 600 {
        let cut: String = one_line.chars().take(600).collect();
        return format!("{cut}...");
    }
    one_line
}

#[cfg(test)]
mod tests {
    use super::urls;

    #[test]
    fn queries_and_user_info_are_hidden_everywhere_in_a_text() {
        let cases = [
            (
                "GET https://b.s3.amazonaws.com/k?X-Amz-Signature=SECRET failed",
                "GET https://b.s3.amazonaws.com/k?<query hidden> failed",
            ),
            (
                "'http://user:SECRET@host:9000/m.safetensors': 403",
                "'http://<credentials hidden>@host:9000/m.safetensors': 403",
            ),
            (
                "s3://AKID:SE/CR+ET@bucket/key?x=SECRET",
                "s3://<credentials hidden>@bucket/key?<query hidden>",
            ),
            ("(az://c/k?sig=SECRET)", "(az://c/k?<query hidden>)"),
            (
                "s3://K:SECRET@b/k?sig=SECRET: broken.",
                "s3://<credentials hidden>@b/k?<query hidden>: broken.",
            ),
            (
                "s3://bucket/user@example.com/model",
                "s3://bucket/user@example.com/model",
            ),
            ("no url: a://?", "no url: a://?<query hidden>"),
            ("://SECRET@x", "://SECRET@x"),
            ("", ""),
        ];
        for (text, want) in cases {
            assert_eq!(urls(text), want, "{text}");
        }
    }

    #[test]
    fn never_panics_on_any_char_boundary() {
        let text = "x://ü:ß@h/ä?ö s3://€:€@€/€?€";
        for end in 0..=text.len() {
            if text.is_char_boundary(end) {
                let _ = urls(&text[..end]);
            }
        }
        assert!(!urls(text).contains('ß'));
    }
}
