//! A store's configuration: the caller's options, the environment and configuration-file
//! defaults, in that order of precedence; fastload's timeouts and retry policy where none is given;
//! and the builder of each kind of store.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};
use object_store::http::HttpBuilder;
use object_store::{
    BackoffConfig, ClientConfigKey, ClientOptions, ObjectStore, ObjectStoreScheme, RetryConfig,
};
use url::Url;

use super::credentials;
use super::values::{self, Given};
use super::{config_error, failure, redact};
use crate::error::Result;

/// Retries of a failing request, unless the options say otherwise (`max_retries`).
pub const DEFAULT_MAX_RETRIES: usize = 5;
/// First wait before a retry (`retry_init_backoff`); doubled each time, with jitter.
pub const DEFAULT_INIT_BACKOFF: Duration = Duration::from_millis(200);
/// Longest wait between retries (`retry_max_backoff`).
pub const DEFAULT_MAX_BACKOFF: Duration = Duration::from_secs(8);
/// No retry starts this long after a request's first attempt (`retry_timeout`).
pub const DEFAULT_RETRY_TIMEOUT: Duration = Duration::from_secs(120);
/// Client timeouts fastload sets unless the options or the environment set them: connecting,
/// waiting for any byte of a response (a stalled store), and one whole request (at most
/// [`crate::copy::CHUNK`] bytes, or a header).
pub const DEFAULT_TIMEOUTS: [(ClientConfigKey, &str); 3] = [
    (ClientConfigKey::ConnectTimeout, "10s"),
    (ClientConfigKey::ReadTimeout, "30s"),
    (ClientConfigKey::Timeout, "300s"),
];

/// Options fastload reads itself (the retry policy); every other option goes to the store's
/// builder, which refuses a key it does not know.
const RETRY_KEYS: [&str; 5] = [
    "max_retries",
    "retry_timeout",
    "retry_init_backoff",
    "retry_max_backoff",
    "retry_backoff_base",
];

/// What configures a [`Store`] besides its URL.
#[derive(Clone, Default)]
pub struct Settings {
    /// The caller's options (`object_store`'s configuration keys, e.g. `aws_endpoint`,
    /// `aws_region`, `timeout`, `read_timeout`, plus [`RETRY_KEYS`]); they win over everything.
    pub options: Vec<(String, String)>,
    /// Values from configuration files (an AWS profile's keys, region and endpoint): used where
    /// neither the environment nor the options give a value.
    pub defaults: Vec<(String, String)>,
}

// Hand-written: the values are credentials, never printed.
impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let keys = |kv: &[(String, String)]| kv.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>();
        f.debug_struct("Settings")
            .field("options", &keys(&self.options))
            .field("defaults", &keys(&self.defaults))
            .finish()
    }
}

fn parse_duration(key: &str, value: &str) -> Result<Duration> {
    humantime::parse_duration(value.trim()).map_err(|_| {
        config_error(format!(
            "option '{key}': '{value}' is not a duration (e.g. '30s', '500ms', '2m')"
        ))
    })
}

/// The retry policy: fastload's defaults, changed by the options in [`RETRY_KEYS`].
fn retry_config(options: &HashMap<&str, &str>) -> Result<RetryConfig> {
    let mut retry = RetryConfig {
        backoff: BackoffConfig {
            init_backoff: DEFAULT_INIT_BACKOFF,
            max_backoff: DEFAULT_MAX_BACKOFF,
            base: 2.0,
        },
        max_retries: DEFAULT_MAX_RETRIES,
        retry_timeout: DEFAULT_RETRY_TIMEOUT,
    };
    for (&key, &value) in options {
        match key {
            "max_retries" => {
                retry.max_retries = value
                    .trim()
                    .parse::<usize>()
                    .ok()
                    .filter(|n| *n <= 100)
                    .ok_or_else(|| {
                        config_error(format!(
                            "option 'max_retries': '{value}' is not a count from 0 to 100"
                        ))
                    })?
            }
            "retry_timeout" => retry.retry_timeout = parse_duration(key, value)?,
            "retry_init_backoff" => retry.backoff.init_backoff = parse_duration(key, value)?,
            "retry_max_backoff" => retry.backoff.max_backoff = parse_duration(key, value)?,
            "retry_backoff_base" => {
                retry.backoff.base = value
                    .trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|b| (1.0..=10.0).contains(b))
                    .ok_or_else(|| {
                        config_error(format!(
                            "option 'retry_backoff_base': '{value}' is not a number from 1 to 10"
                        ))
                    })?
            }
            _ => {}
        }
    }
    Ok(retry)
}

/// `AWS_`, `GOOGLE_` or `AZURE_` variables of the environment, as the builders' `from_env`
/// reads them (names lowercased).
fn environment(prefix: &str) -> Vec<(String, String)> {
    std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .filter(|(k, _)| k.starts_with(prefix))
        .map(|(k, v)| (k.to_ascii_lowercase(), v))
        .collect()
}

/// Builds a cloud store's builder in precedence order (later wins): fastload's client
/// defaults, configuration-file defaults, the environment, the URL, the caller's options. Unknown
/// keys in the caller's options are refused; unknown environment variables are skipped, as
/// `from_env` skips them. The values that win are checked ([`values::check`]) before the
/// builder sees them.
macro_rules! configure {
    ($builder:expr, $key:ty, $prefix:expr, $url:expr, $options:expr, $defaults:expr) => {{
        let mut b = $builder;
        let mut given: Vec<Given> = Vec::new();
        for (key, value) in DEFAULT_TIMEOUTS {
            b = b.with_config(<$key>::Client(key), value);
        }
        // in order of precedence, lowest first: each later value replaces an earlier one
        let mut pairs: Vec<($key, String, &str)> = Vec::new();
        for (k, v) in $defaults {
            let key: $key = k
                .parse()
                .map_err(|_| config_error(format!("configuration file key '{k}' is unknown")))?;
            pairs.push((key, format!("configuration file value '{k}'"), v.as_str()));
        }
        let env = environment($prefix);
        for (k, v) in &env {
            if let Ok(key) = k.parse::<$key>() {
                let source = format!("environment variable {}", k.to_ascii_uppercase());
                pairs.push((key, source, v.as_str()));
            }
        }
        for (key, source, value) in &pairs {
            given.push(Given {
                key: key.as_ref().to_string(),
                source: source.clone(),
                value: value.to_string(),
            });
        }
        let mut options: Vec<($key, &str)> = Vec::new();
        for (k, v) in $options {
            let key: $key = k.to_ascii_lowercase().parse().map_err(|_| {
                config_error(format!("unknown option '{k}' for this kind of store"))
            })?;
            given.push(Given {
                key: key.as_ref().to_string(),
                source: format!("storage option '{k}'"),
                value: v.clone(),
            });
            options.push((key, v.as_str()));
        }
        values::check(&given)?;
        for (key, _, value) in pairs {
            b = b.with_config(key, value);
        }
        b = b.with_url($url);
        for (key, value) in options {
            b = b.with_config(key, value);
        }
        b
    }};
}

/// The client of the store `parsed` (`url` as given, for messages) names, of kind `scheme`,
/// configured by `settings` (see [`Settings`] and `configure!` for the precedence).
///
/// An `http://` endpoint allows plain HTTP, as the AWS SDKs do; otherwise only HTTPS is used.
pub(super) fn build(
    url: &str,
    parsed: &Url,
    scheme: ObjectStoreScheme,
    settings: &Settings,
) -> Result<Arc<dyn ObjectStore>> {
    let base = parsed[..url::Position::BeforePath].to_string();
    let options: Vec<(String, String)> = settings
        .options
        .iter()
        .filter(|(k, _)| !RETRY_KEYS.contains(&k.as_str()))
        .cloned()
        .collect();
    let retry_options: HashMap<&str, &str> = settings
        .options
        .iter()
        .filter(|(k, _)| RETRY_KEYS.contains(&k.as_str()))
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let retry = retry_config(&retry_options)?;
    let user_http = options
        .iter()
        .any(|(k, _)| k.to_ascii_lowercase().ends_with("allow_http"));
    let plain = |endpoint: Option<String>| {
        !user_http && endpoint.is_some_and(|e| e.trim().starts_with("http://"))
    };
    let inner: Arc<dyn ObjectStore> = match scheme {
        ObjectStoreScheme::AmazonS3 => {
            let mut b = configure!(
                AmazonS3Builder::new(),
                AmazonS3ConfigKey,
                "AWS_",
                url,
                &options,
                &settings.defaults
            );
            if plain(b.get_config_value(&AmazonS3ConfigKey::Endpoint)) {
                b = b.with_config(
                    AmazonS3ConfigKey::Client(ClientConfigKey::AllowHttp),
                    "true",
                );
            }
            if credentials::from_instance(&b) {
                let provider = credentials::instance(&b).map_err(failure)?;
                b = b.with_credentials(provider);
            }
            Arc::new(b.with_retry(retry).build().map_err(failure)?)
        }
        ObjectStoreScheme::GoogleCloudStorage => {
            let mut b = configure!(
                GoogleCloudStorageBuilder::new(),
                GoogleConfigKey,
                "GOOGLE_",
                url,
                &options,
                &settings.defaults
            );
            if let Ok(path) = std::env::var("SERVICE_ACCOUNT") {
                if b.get_config_value(&GoogleConfigKey::ServiceAccount)
                    .is_none()
                {
                    b = b.with_service_account_path(path);
                }
            }
            if plain(b.get_config_value(&GoogleConfigKey::BaseUrl)) {
                b = b.with_config(GoogleConfigKey::Client(ClientConfigKey::AllowHttp), "true");
            }
            Arc::new(b.with_retry(retry).build().map_err(failure)?)
        }
        ObjectStoreScheme::MicrosoftAzure => {
            let mut b = configure!(
                MicrosoftAzureBuilder::new(),
                AzureConfigKey,
                "AZURE_",
                url,
                &options,
                &settings.defaults
            );
            if let Ok(endpoint) = std::env::var("MSI_ENDPOINT") {
                b = b.with_msi_endpoint(endpoint);
            }
            let emulator = b
                .get_config_value(&AzureConfigKey::UseEmulator)
                .is_some_and(|v| v == "true");
            if emulator || plain(b.get_config_value(&AzureConfigKey::Endpoint)) {
                b = b.with_config(AzureConfigKey::Client(ClientConfigKey::AllowHttp), "true");
            }
            Arc::new(b.with_retry(retry).build().map_err(failure)?)
        }
        ObjectStoreScheme::Http => {
            let mut client = ClientOptions::new();
            for (key, value) in DEFAULT_TIMEOUTS {
                client = client.with_config(key, value);
            }
            client = client.with_allow_http(parsed.scheme() == "http");
            let mut given = Vec::new();
            for (k, v) in &options {
                let key: ClientConfigKey = k
                    .to_ascii_lowercase()
                    .parse()
                    .map_err(|_| config_error(format!("unknown option '{k}' for an HTTP store")))?;
                given.push(Given {
                    key: key.as_ref().to_string(),
                    source: format!("storage option '{k}'"),
                    value: v.clone(),
                });
                client = client.with_config(key, v.as_str());
            }
            values::check(&given)?;
            let b = HttpBuilder::new()
                .with_url(base.clone())
                .with_client_options(client)
                .with_retry(retry);
            Arc::new(b.build().map_err(failure)?)
        }
        other => {
            return Err(config_error(format!(
                "'{}' is a {other:?} URL; fastload reads s3://, gs://, az:// and http(s)://",
                redact(url)
            )))
        }
    };
    Ok(inner)
}
