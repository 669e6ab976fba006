//! S3 credentials from the instance metadata endpoint, the last place they are looked for: asked
//! with a short retry policy of their own, and, when none come, an error that says so.
//!
//! With no keys in the options, the environment or the AWS files (and no web identity or
//! container credentials), `object_store` asks the EC2 instance metadata endpoint, with the
//! store's retry policy: off EC2 a load failed after minutes (122 s where the endpoint stalls) as
//! `[store-unavailable]`, never saying that no credentials were found. Here the endpoint is
//! asked by a client of its own ([`METADATA_TIMEOUTS`], [`metadata_retry`]), and its failure is
//! `Unauthenticated`: `[store-denied]`, naming where credentials were looked for.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey, AwsCredential, AwsCredentialProvider};
use object_store::{BackoffConfig, ClientConfigKey, CredentialProvider, RetryConfig};

use super::redact;

/// Timeouts of requests to the metadata endpoint: on EC2 it answers in milliseconds.
pub const METADATA_TIMEOUTS: [(ClientConfigKey, &str); 3] = [
    (ClientConfigKey::ConnectTimeout, "1s"),
    (ClientConfigKey::ReadTimeout, "2s"),
    (ClientConfigKey::Timeout, "5s"),
];

/// One retry, soon: a throttled endpoint gets a second chance, a missing one costs seconds.
fn metadata_retry() -> RetryConfig {
    RetryConfig {
        backoff: BackoffConfig {
            init_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_millis(500),
            base: 2.0,
        },
        max_retries: 1,
        retry_timeout: Duration::from_secs(10),
    }
}

/// Whether `builder` would ask the instance metadata endpoint for credentials: no keys, no web
/// identity, no container credentials, and requests are signed.
pub fn from_instance(builder: &AmazonS3Builder) -> bool {
    let set = |key: AmazonS3ConfigKey| builder.get_config_value(&key).is_some();
    let unsigned = builder
        .get_config_value(&AmazonS3ConfigKey::SkipSignature)
        .is_some_and(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "on" | "yes"));
    !(unsigned
        || set(AmazonS3ConfigKey::AccessKeyId)
        || set(AmazonS3ConfigKey::SecretAccessKey)
        || set(AmazonS3ConfigKey::WebIdentityTokenFile)
        || set(AmazonS3ConfigKey::ContainerCredentialsRelativeUri)
        || set(AmazonS3ConfigKey::ContainerCredentialsFullUri))
}

/// The instance credentials provider `builder` would use, built with the metadata endpoint's
/// own timeouts and retries, its failures reported as missing credentials.
pub fn instance(builder: &AmazonS3Builder) -> object_store::Result<AwsCredentialProvider> {
    let mut probe = builder.clone().with_retry(metadata_retry());
    for (key, value) in METADATA_TIMEOUTS {
        probe = probe.with_config(AmazonS3ConfigKey::Client(key), value);
    }
    let inner = probe.build()?.credentials().clone();
    Ok(Arc::new(InstanceOnly { inner }))
}

#[derive(Debug)]
struct InstanceOnly {
    inner: AwsCredentialProvider,
}

type Credential = object_store::Result<Arc<AwsCredential>>;

impl CredentialProvider for InstanceOnly {
    type Credential = AwsCredential;

    fn get_credential<'a, 'b>(&'a self) -> Pin<Box<dyn Future<Output = Credential> + Send + 'b>>
    where
        'a: 'b,
        Self: 'b,
    {
        Box::pin(async move {
            self.inner.get_credential().await.map_err(|e| {
                let why = format!(
                    "no AWS credentials found: none in storage_options, the environment \
                     (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_WEB_IDENTITY_TOKEN_FILE, \
                     AWS_CONTAINER_CREDENTIALS_*) or the AWS files (AWS_PROFILE), and the \
                     instance metadata endpoint gave none ({})",
                    redact(&e.to_string())
                );
                object_store::Error::Unauthenticated {
                    path: String::new(),
                    source: why.into(),
                }
            })
        })
    }
}
