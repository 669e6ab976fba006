//! Tests of the object storage source that need no server.

use super::*;

#[test]
fn a_query_in_a_url_never_reaches_a_message() {
    let got = redact("error sending request for url (https://acct.blob.core.windows.net/c/k?sv=1&sig=SECRET): reset");
    assert!(!got.contains("SECRET"), "{got}");
    assert!(
        got.contains("https://acct.blob.core.windows.net/c/k?<query hidden>"),
        "{got}"
    );
}
