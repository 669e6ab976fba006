//! The values a store is configured with, checked before a client is built: a credential or an
//! endpoint with a character a request cannot carry (a newline left from a file, a space) made
//! `object_store` panic when it signed the first request, and a value it cannot parse
//! (`timeout="thirty"`) failed at the first request as if the store were down. Here each is a
//! [`StoreFailure::Config`] naming the key and where it came from, never the value (it may be a
//! secret).
//!
//! [`StoreFailure::Config`]: crate::error::StoreFailure::Config

use url::Url;

use super::config_error;
use crate::error::Result;

/// Values sent in request headers or signed (credentials, names, regions): visible ASCII only.
const HEADER_BOUND: [&str; 21] = [
    "aws_access_key_id",
    "aws_secret_access_key",
    "aws_session_token",
    "aws_region",
    "aws_default_region",
    "aws_bucket",
    "aws_role_arn",
    "aws_role_session_name",
    "google_bucket",
    "google_bearer_token",
    "azure_storage_account_name",
    "azure_storage_account_key",
    "azure_storage_client_id",
    "azure_storage_client_secret",
    "azure_storage_tenant_id",
    "azure_storage_sas_key",
    "azure_storage_token",
    "azure_container_name",
    "azure_fabric_session_token",
    "azure_object_id",
    "azure_storage_encryption_key",
];

/// Values that are URLs requests go to: visible ASCII, and an `http(s)://` URL with a host.
const ENDPOINTS: [&str; 11] = [
    "aws_endpoint",
    "aws_endpoint_url_s3",
    "aws_endpoint_url_sts",
    "aws_metadata_endpoint",
    "aws_container_credentials_full_uri",
    "google_base_url",
    "azure_storage_endpoint",
    "azure_storage_authority_host",
    "azure_msi_endpoint",
    "azure_fabric_token_service_url",
    "proxy_url",
];

/// Documents that may span lines (a service account's JSON key, a PEM certificate).
const MULTI_LINE: [&str; 2] = ["google_service_account_key", "proxy_ca_certificate"];

const BOOLEANS: [&str; 20] = [
    "allow_http",
    "allow_invalid_certificates",
    "disable_system_certificates",
    "http1_only",
    "http2_only",
    "http2_keep_alive_while_idle",
    "randomize_addresses",
    "aws_imdsv1_fallback",
    "aws_virtual_hosted_style_request",
    "aws_s3_express",
    "aws_unsigned_payload",
    "aws_skip_signature",
    "aws_disable_tagging",
    "aws_disable_bulk_delete",
    "google_skip_signature",
    "azure_storage_use_emulator",
    "azure_use_fabric_endpoint",
    "azure_use_azure_cli",
    "azure_skip_signature",
    "azure_disable_tagging",
];

const DURATIONS: [&str; 6] = [
    "timeout",
    "connect_timeout",
    "read_timeout",
    "pool_idle_timeout",
    "http2_keep_alive_interval",
    "http2_keep_alive_timeout",
];

/// One configured value: the key as `object_store` names it, where it came from (for messages:
/// "storage option 'aws_session_token'", "environment variable AWS_SESSION_TOKEN"), the value.
pub(super) struct Given {
    pub key: String,
    pub source: String,
    pub value: String,
}

/// Checks the value each key ends up with (the last of `given`, which is in precedence order,
/// lowest first).
pub(super) fn check(given: &[Given]) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    for g in given.iter().rev() {
        if seen.insert(g.key.as_str()) {
            check_one(g)?;
        }
    }
    Ok(())
}

fn name(c: char) -> String {
    match c {
        '\n' | '\r' | '\u{2028}' | '\u{2029}' | '\u{85}' => "a line break".into(),
        '\t' => "a tab".into(),
        ' ' => "a space".into(),
        c if c.is_whitespace() => "a space character".into(),
        c if c.is_control() => format!("a control character (U+{:04X})", c as u32),
        _ => "a character outside ASCII".into(),
    }
}

fn check_one(g: &Given) -> Result<()> {
    let key = g.key.as_str();
    let label = if g.source.contains(key) {
        g.source.clone()
    } else {
        format!("{} ({key})", g.source)
    };
    let refuse = |why: String| config_error(format!("{label}: {why} (the value is not shown)"));
    let bad_char = |allowed: &dyn Fn(char) -> bool, what: &str| -> Result<()> {
        match g.value.chars().enumerate().find(|(_, c)| !allowed(*c)) {
            Some((at, c)) => Err(refuse(format!(
                "{} at character {} of {}: {what}",
                name(c),
                at + 1,
                g.value.chars().count()
            ))),
            None => Ok(()),
        }
    };
    let visible = |c: char| c.is_ascii_graphic();
    if HEADER_BOUND.contains(&key) {
        bad_char(&visible, "a request header cannot carry it")?;
    } else if ENDPOINTS.contains(&key) {
        bad_char(&visible, "a URL cannot carry it")?;
        let ok = Url::parse(g.value.trim())
            .ok()
            .filter(|u| matches!(u.scheme(), "http" | "https") && u.host_str().is_some());
        if ok.is_none() {
            return Err(refuse("not an http:// or https:// URL with a host".into()));
        }
    } else if !MULTI_LINE.contains(&key) {
        bad_char(&|c| !c.is_control(), "no configuration value has one")?;
    }
    let value = g.value.trim();
    if BOOLEANS.contains(&key)
        && !matches!(
            value.to_ascii_lowercase().as_str(),
            "1" | "true" | "on" | "yes" | "y" | "0" | "false" | "off" | "no" | "n"
        )
    {
        return Err(refuse("not true or false".into()));
    }
    if DURATIONS.contains(&key) && humantime::parse_duration(value).is_err() {
        return Err(refuse("not a duration (e.g. '30s', '500ms', '2m')".into()));
    }
    if key == "pool_max_idle_per_host" && value.parse::<usize>().is_err() {
        return Err(refuse("not a count".into()));
    }
    if key == "http2_max_frame_size" && value.parse::<u32>().is_err() {
        return Err(refuse("not a size in bytes".into()));
    }
    if key == "aws_checksum_algorithm"
        && !matches!(value.to_ascii_lowercase().as_str(), "sha256" | "crc64nvme")
    {
        return Err(refuse("not one of sha256, crc64nvme".into()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn given(key: &str, value: &str) -> Vec<Given> {
        vec![Given {
            key: key.into(),
            source: format!("storage option '{key}'"),
            value: value.into(),
        }]
    }

    fn message(key: &str, value: &str) -> String {
        check(&given(key, value)).unwrap_err().to_string()
    }

    #[test]
    fn a_credential_with_a_newline_is_refused_naming_the_key_not_the_value() {
        let m = message("aws_session_token", "SECRET-TOKEN\n");
        assert!(
            m.contains("aws_session_token") && m.contains("line break"),
            "{m}"
        );
        assert!(!m.contains("SECRET"), "{m}");
    }

    #[test]
    fn an_endpoint_with_a_space_or_no_host_is_refused() {
        assert!(message("aws_endpoint", "http://127.0 .0.1:9").contains("a space"));
        assert!(message("aws_endpoint", "127.0.0.1:9000").contains("not an http://"));
        assert!(check(&given("aws_endpoint", "http://127.0.0.1:9000")).is_ok());
    }

    #[test]
    fn values_the_client_cannot_parse_are_refused_naming_the_key() {
        assert!(message("timeout", "thirty").contains("'timeout': not a duration"));
        assert!(message("aws_checksum_algorithm", "md5").contains("sha256"));
        assert!(message("allow_http", "maybe").contains("true or false"));
        assert!(check(&given("timeout", "30s")).is_ok());
    }

    #[test]
    fn only_the_value_that_wins_is_checked() {
        let mut g = given("aws_region", "bad region");
        g.push(Given {
            key: "aws_region".into(),
            source: "storage option 'aws_region'".into(),
            value: "eu-west-1".into(),
        });
        assert!(check(&g).is_ok());
    }

    #[test]
    fn documents_may_span_lines_and_paths_may_have_spaces() {
        assert!(check(&given("google_service_account_key", "{\n \"a\": 1\n}")).is_ok());
        assert!(check(&given("aws_web_identity_token_file", "/my dir/token")).is_ok());
    }
}
