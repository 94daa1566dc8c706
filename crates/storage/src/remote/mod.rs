//! Object storage: checkpoints at `s3://`, `gs://`, `az://` and `http(s)://` URLs, through the
//! `object_store` crate, configured the standard way (`AWS_*`, `GOOGLE_*`, `AZURE_*`
//! environment variables; [`set_endpoint_url`] or `AWS_ENDPOINT_URL` for S3-compatible
//! servers). `file://` URLs are plain paths.
//!
//! This module owns the network. Reading, a URL becomes a [`mirror::Mirror`]: a scratch
//! folder of *sparse* files of the objects' sizes, into which ranged GETs write only what is
//! read — first the bytes the formats need to open the checkpoint (the formats' index reads),
//! then the source bytes of each copy, asked for by the executor and the loader just before
//! they read them (the mirror is their [`Storage`](crate::Storage)). Everything else reads
//! the mirror as local files.
//! Writing, the destination is built in a local scratch folder as any other, then each file
//! is sent as a multipart upload, the object that makes the checkpoint loadable last
//! ([`upload`]).

pub mod mirror;
pub mod upload;

use crate::error::{one_line, Error, Result};
use object_store::multipart::MultipartStore;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, RetryConfig};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

pub use mirror::{fetch_stats, FetchStats};

/// URL schemes read and written through `object_store`.
const SCHEMES: [&str; 9] = [
    "s3", "s3a", "gs", "az", "azure", "abfs", "abfss", "http", "https",
];

/// The object stores, as a [`Backend`](crate::source::Backend): `s3://`, `gs://`, `az://`,
/// `http(s)://` URLs opened as local mirrors of their objects.
pub struct ObjectStores;

impl crate::source::Backend for ObjectStores {
    fn schemes(&self) -> &'static [&'static str] {
        &SCHEMES
    }

    fn open(&self, url: &Path) -> Result<crate::Opened> {
        let m = mirror::Mirror::open(url)?;
        Ok(crate::Opened {
            root: m.root().to_path_buf(),
            url: Some(m.url().to_string()),
            storage: m,
        })
    }
}

/// Whether `path` is an object-store URL (`s3://…` and the other `SCHEMES`), not a path.
pub fn is_url(path: &Path) -> bool {
    scheme(path).is_some_and(|s| SCHEMES.contains(&s.as_str()))
}

/// `path` with a `file://` URL turned into the plain path it names; other paths unchanged.
pub fn local_path(path: &Path) -> PathBuf {
    match path.to_str().and_then(|s| s.strip_prefix("file://")) {
        Some(rest) => PathBuf::from(rest),
        None => path.to_path_buf(),
    }
}

/// The lower-cased scheme of `path` when it reads `scheme://…`.
pub fn scheme(path: &Path) -> Option<String> {
    let s = path.to_str()?;
    let (scheme, _) = s.split_once("://")?;
    (!scheme.is_empty()
        && scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '+'))
    .then(|| scheme.to_ascii_lowercase())
}

static ENDPOINT: OnceLock<String> = OnceLock::new();

/// Send S3 requests to `url` (an S3-compatible server such as MinIO) instead of AWS; the
/// first call wins. Without it, `AWS_ENDPOINT_URL` (or `AWS_ENDPOINT`) is used when set.
pub fn set_endpoint_url(url: &str) {
    let _ = ENDPOINT.set(url.to_string());
}

/// How many times a failed request is retried (only server errors and dropped connections
/// are; a refused credential is not), and for how long at most.
const RETRIES: usize = 3;
const RETRY_FOR: Duration = Duration::from_secs(20);

/// A store and the prefix a URL names in it.
#[derive(Clone)]
pub struct Remote {
    store: Arc<dyn ObjectStore>,
    /// The same store's multipart-upload calls, where it has them (not plain HTTP).
    multipart: Option<Arc<dyn MultipartStore>>,
    root: ObjPath,
    /// The URL as given, without a trailing `/`, for messages.
    url: String,
}

impl std::fmt::Debug for Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Remote")
            .field("store", &self.store)
            .field("multipart", &self.multipart.is_some())
            .field("root", &self.root)
            .field("url", &self.url)
            .finish()
    }
}

impl Remote {
    /// The store and prefix `url` names, configured from the environment.
    pub fn parse(url: &Path) -> Result<Remote> {
        // TLS is rustls with ring's crypto (Cargo.toml), which reqwest needs installed as the
        // process default before it builds a client. Err only when one is installed already
        // (by an earlier call, or by the program embedding reshard): that one serves.
        // (rustls deprecates ring's provider for want of post-quantum key exchange.)
        #[allow(deprecated)]
        let _ = rustls::crypto::ring::default_provider().install_default();
        let shown = url.display().to_string().trim_end_matches('/').to_string();
        let bad = |msg: String| Error::format(&shown, msg);
        let text = url
            .to_str()
            .ok_or_else(|| bad("is not a valid URL (not UTF-8)".into()))?;
        let parsed = url::Url::parse(text).map_err(|e| bad(format!("is not a valid URL: {e}")))?;
        let retry = RetryConfig {
            max_retries: RETRIES,
            retry_timeout: RETRY_FOR,
            ..Default::default()
        };
        let scheme = parsed.scheme().to_ascii_lowercase();
        fn both<S: ObjectStore + MultipartStore>(
            s: S,
        ) -> (Arc<dyn ObjectStore>, Option<Arc<dyn MultipartStore>>) {
            let s = Arc::new(s);
            (s.clone(), Some(s))
        }
        let (store, multipart) = match scheme.as_str() {
            "s3" | "s3a" => {
                let mut b = object_store::aws::AmazonS3Builder::from_env()
                    .with_url(text)
                    .with_retry(retry);
                let endpoint = ENDPOINT.get().cloned().or_else(|| {
                    std::env::var("AWS_ENDPOINT_URL")
                        .or_else(|_| std::env::var("AWS_ENDPOINT"))
                        .ok()
                });
                if let Some(e) = endpoint {
                    b = b
                        .with_endpoint(&e)
                        .with_allow_http(e.starts_with("http://"));
                    if std::env::var_os("AWS_VIRTUAL_HOSTED_STYLE_REQUEST").is_none() {
                        b = b.with_virtual_hosted_style_request(false);
                    }
                }
                if std::env::var_os("AWS_REGION").is_none()
                    && std::env::var_os("AWS_DEFAULT_REGION").is_none()
                {
                    b = b.with_region("us-east-1");
                }
                both(b.build().map_err(|e| bad(describe(&e)))?)
            }
            "gs" => both(
                object_store::gcp::GoogleCloudStorageBuilder::from_env()
                    .with_url(text)
                    .with_retry(retry)
                    .build()
                    .map_err(|e| bad(describe(&e)))?,
            ),
            "az" | "azure" | "abfs" | "abfss" => both(
                object_store::azure::MicrosoftAzureBuilder::from_env()
                    .with_url(text)
                    .with_retry(retry)
                    .build()
                    .map_err(|e| bad(describe(&e)))?,
            ),
            "http" | "https" => (
                Arc::new(
                    object_store::http::HttpBuilder::new()
                        .with_url(&parsed[..url::Position::BeforePath])
                        .with_retry(retry)
                        .build()
                        .map_err(|e| bad(describe(&e)))?,
                ) as Arc<dyn ObjectStore>,
                None,
            ),
            other => return Err(bad(format!("`{other}://` is not a supported URL scheme"))),
        };
        let path = match scheme.as_str() {
            "http" | "https" => parsed.path().to_string(),
            _ => object_store::ObjectStoreScheme::parse(&parsed)
                .map(|(_, p)| p.to_string())
                .map_err(|e| bad(format!("is not a valid object-store URL: {e}")))?,
        };
        let path = percent_decode(&path);
        let root = ObjPath::parse(path.trim_matches('/'))
            .map_err(|e| bad(format!("names no valid object path: {e}")))?;
        Ok(Remote {
            store,
            multipart,
            root,
            url: shown,
        })
    }

    /// The object `rel` (a `/`-separated path under the prefix).
    pub fn key(&self, rel: &str) -> ObjPath {
        if rel.is_empty() {
            return self.root.clone();
        }
        rel.split('/')
            .fold(self.root.clone(), |p, part| p.clone().join(part))
    }

    /// How `rel` is named in messages: the URL joined with it.
    pub fn shown(&self, rel: &str) -> String {
        if rel.is_empty() {
            self.url.clone()
        } else {
            format!("{}/{rel}", self.url)
        }
    }

    /// The URL as given.
    pub fn url(&self) -> &str {
        &self.url
    }
}

/// This machine's name as it goes into scratch folder names and journal entries (letters,
/// digits and `-`, at most 40): what processes of other machines sharing the folder left
/// is not judged by pid here.
pub fn host_tag() -> &'static str {
    static TAG: OnceLock<String> = OnceLock::new();
    TAG.get_or_init(|| {
        let name = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        let tag: String = name
            .trim()
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .take(40)
            .collect();
        if tag.is_empty() {
            "host".into()
        } else {
            tag
        }
    })
}

/// `%XX` escapes in a URL path decoded (object keys are stored unescaped).
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let hex = |c: u8| (c as char).to_digit(16);
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The runtime the object-store requests run on: a few threads of its own, started on first
/// use (the executor's and the loader's threads block on it).
pub fn runtime() -> Result<&'static tokio::runtime::Runtime> {
    static RT: OnceLock<std::result::Result<tokio::runtime::Runtime, String>> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .thread_name("reshard-net")
            .enable_all()
            .build()
            .map_err(|e| e.to_string())
    })
    .as_ref()
    .map_err(|e| Error::usage(format!("cannot start the network threads: {e}")))
}

/// Run `f` to completion on the network runtime, from a thread that is not one of its own.
pub fn block_on<F: std::future::Future>(f: F) -> Result<F::Output> {
    Ok(runtime()?.block_on(f))
}

/// One line for an object-store error: a missing object as "not found", a refused credential
/// as "access denied", others as the store says, without the request's retry chatter.
pub fn describe(e: &object_store::Error) -> String {
    describe_for("", e)
}

/// [`describe`] for an object under `url`: a refused credential names the environment
/// variables of its store.
fn describe_for(url: &str, e: &object_store::Error) -> String {
    use std::error::Error as _;
    if let object_store::Error::NotFound { .. } = e {
        return "not found".into();
    }
    let mut text = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        let t = s.to_string();
        if !text.contains(&t) {
            text = format!("{text}: {t}");
        }
        src = s.source();
    }
    let lower = text.to_ascii_lowercase();
    let scheme = url.split("://").next().unwrap_or("").to_ascii_lowercase();
    let vars = match scheme.as_str() {
        "s3" | "s3a" => "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN",
        "gs" => "GOOGLE_SERVICE_ACCOUNT / GOOGLE_APPLICATION_CREDENTIALS",
        "az" | "azure" | "abfs" | "abfss" => {
            "AZURE_STORAGE_ACCOUNT_NAME / AZURE_STORAGE_ACCOUNT_KEY"
        }
        _ => "the store's environment variables",
    };
    // No credentials in the environment: the crate asked the cloud's instance metadata
    // service instead, which is not there.
    if lower.contains("169.254.169.254") {
        return format!(
            "no credentials: set {vars} (the cloud instance metadata service, asked instead, refused or is not there)"
        );
    }
    // A server that could not be reached: the cause, after the retries.
    if let Some(at) = lower.find("error sending request") {
        let cause = text[at..]
            .rsplit(": ")
            .next()
            .unwrap_or(&text[at..])
            .trim()
            .to_string();
        let retried = if lower.contains("after ") && lower.contains(" retries") {
            format!(" (tried {} times)", RETRIES + 1)
        } else {
            String::new()
        };
        return one_line(&format!("cannot reach the server{retried}: {cause}")).into_owned();
    }
    let denied = [
        "403",
        "forbidden",
        "accessdenied",
        "invalidaccesskeyid",
        "signaturedoesnotmatch",
        "unauthenticated",
        "permission denied",
    ];
    // An S3 error document: its code and message say it best.
    let tag = |name: &str| {
        let open = format!("<{name}>");
        let at = text.find(&open)? + open.len();
        let len = text[at..].find(&format!("</{name}>"))?;
        Some(text[at..at + len].to_string())
    };
    let status = text
        .find("status code: ")
        .map(|at| &text[at + "status code: ".len()..])
        .map(|s| s.split(':').next().unwrap_or(s).trim().to_string());
    let mut text = match (tag("Code"), tag("Message")) {
        (Some(code), Some(msg)) => match status {
            Some(st) => format!("the server answered {code} ({st}): {msg}"),
            None => format!("the server answered {code}: {msg}"),
        },
        _ => one_line(&text).into_owned(),
    };
    if text.len() > 400 {
        let mut cut = 400;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
        text.push('…');
    }
    if denied.iter().any(|d| lower.contains(d)) {
        format!("access denied (check the credentials: {vars}): {text}")
    } else {
        text
    }
}

/// An object-store error about `what` (a URL), as the crate's error.
pub fn error(what: &str, e: &object_store::Error) -> Error {
    Error::format(what, describe_for(what, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_in_one_line() {
        let generic = |text: &str| object_store::Error::Generic {
            store: "S3",
            source: text.to_string().into(),
        };
        let denied = describe(&generic(
            "Error performing GET http://h/b?list-type=2 in 4ms - Server returned non-2xx status \
             code: 403 Forbidden: <?xml version=\"1.0\"?>\n<Error><Code>InvalidAccessKeyId</Code>\
             <Message>The key is not known.</Message></Error>",
        ));
        assert!(
            denied.starts_with("access denied (check the credentials"),
            "{denied}"
        );
        assert!(
            denied.ends_with(
                "the server answered InvalidAccessKeyId (403 Forbidden): The key is not known."
            ),
            "{denied}"
        );
        let missing = describe(&generic(
            "status code: 404 Not Found: <Error><Code>NoSuchBucket</Code><Message>The specified \
             bucket does not exist</Message></Error>",
        ));
        assert_eq!(
            missing,
            "the server answered NoSuchBucket (404 Not Found): The specified bucket does not exist"
        );
        let unreachable = describe(&generic(
            "Error performing GET http://127.0.0.1:9/b in 4ms, after 3 retries, max_retries: 3, \
             retry_timeout: 20s  - HTTP error: error sending request: client error (Connect): \
             tcp connect error: Connection refused (os error 111)",
        ));
        assert_eq!(
            unreachable,
            "cannot reach the server (tried 4 times): Connection refused (os error 111)"
        );
        let no_keys = describe_for(
            "s3://b/k",
            &generic("Error performing PUT http://169.254.169.254/latest/api/token in 9ms - 403"),
        );
        assert!(
            no_keys.starts_with("no credentials: set AWS_ACCESS_KEY_ID"),
            "{no_keys}"
        );
        let long = describe(&generic(&"x\n".repeat(1000)));
        assert!(!long.contains('\n') && long.len() <= 404, "{long}");
    }

    #[test]
    fn urls_and_paths() {
        assert!(is_url(Path::new("s3://bucket/ckpt")));
        assert!(is_url(Path::new("S3://bucket/ckpt")));
        assert!(is_url(Path::new("gs://b/x")));
        assert!(!is_url(Path::new("file:///tmp/x")));
        assert!(!is_url(Path::new("/tmp/s3://x")));
        assert!(!is_url(Path::new("ckpt")));
        assert_eq!(
            local_path(Path::new("file:///tmp/x")),
            PathBuf::from("/tmp/x")
        );
        assert_eq!(local_path(Path::new("rel")), PathBuf::from("rel"));
        assert_eq!(percent_decode("a%20b%2"), "a b%2");
    }

    #[test]
    fn keys_under_the_prefix() {
        let r = Remote::parse(Path::new("s3://bucket/some/ckpt/")).unwrap();
        assert_eq!(r.key("").as_ref(), "some/ckpt");
        assert_eq!(r.key("a/b.distcp").as_ref(), "some/ckpt/a/b.distcp");
        assert_eq!(r.shown("x"), "s3://bucket/some/ckpt/x");
        let e = Remote::parse(Path::new("ftp://x/y"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a supported URL scheme"), "{e}");
    }
}
