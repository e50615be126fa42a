//! Who may call the extender, and over what.
//!
//! - **Mutual TLS** on the extender port: the server presents `--tls-cert-file` and
//!   requires a client certificate signed by `--client-ca-file`; a client without one,
//!   or with one from another CA, is refused in the handshake, before any HTTP.
//! - **Per-verb access** ([`BindAccess`]): every verified client may call `filter` and
//!   `prioritize` (they read the cache and write nothing); `bind` writes the
//!   allocation and the Binding with tessera-scheduler's rights, so only kube-scheduler's
//!   identity (`--bind-client-name`, the certificate's CN or a DNS SAN) may call it, and a
//!   replica handing a bind to the leader (`--peer-client-name`, marked forwarded).
//! - **Plain HTTP only on loopback** ([`choose_transport`]): the sidecar layout, where
//!   tessera-scheduler runs in kube-scheduler's pod and nothing else can reach it. Plain
//!   HTTP on any other address is refused at startup unless `--insecure-listen` says so.
//! - **Probes** on their own plain-HTTP port ([`serve_probes`]): kubelet presents no
//!   client certificate, so `/healthz` and `/readyz` (read-only; they tell whether the
//!   cache is synced, nothing more) are served there and nothing else is.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio::net::{TcpListener, TcpStream};

use crate::extender::{Extender, FORWARDED_HEADER, verb};

/// How long a client may take to finish the TLS handshake: kube-scheduler's takes
/// milliseconds; a client that opens a connection and says nothing holds a file
/// descriptor only this long.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(1);
/// Connections held at once, handshaking or established. Beyond it new ones wait
/// in the kernel's listen backlog, holding no descriptor of ours, so a flood of
/// idle connections never runs the process out of files (1,024 is a common soft
/// limit); idle ones go after [`HANDSHAKE_TIMEOUT`], and the backlog moves on.
pub const MAX_CONNECTIONS: usize = 512;

/// When the first certificate of the PEM file `path` expires, in Unix seconds.
pub fn certificate_not_after(path: &Path) -> Result<i64, TlsError> {
    let certs = read_certs("--tls-cert-file", path)?;
    let first = certs.first().ok_or_else(|| TlsError::Invalid {
        flag: "--tls-cert-file",
        path: path.to_path_buf(),
        problem: "no certificate in the file".into(),
    })?;
    let (_, cert) = x509_parser::parse_x509_certificate(first).map_err(|e| TlsError::Invalid {
        flag: "--tls-cert-file",
        path: path.to_path_buf(),
        problem: format!("not an X.509 certificate: {e}"),
    })?;
    Ok(cert.validity().not_after.timestamp())
}

/// kube-scheduler's identity in its client certificate, by default.
pub const DEFAULT_BIND_CLIENT: &str = "tessera-kube-scheduler";

/// The replicas' own identity (their serving certificate, presented as a client
/// certificate when a follower hands a bind to the leader), by default.
pub const DEFAULT_PEER_CLIENT: &str = "tessera-scheduler";

// === Errors ===

/// Why the TLS files cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read, or is not PEM.
    #[error("{flag} {}: {source}", path.display())]
    Read {
        /// The flag that named the file.
        flag: &'static str,
        /// The file.
        path: PathBuf,
        /// What went wrong.
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    /// A file holds no PEM block of the kind it should (a certificate, a key).
    #[error("{flag} {}: no {what} in it", path.display())]
    Empty {
        /// The flag that named the file.
        flag: &'static str,
        /// The file.
        path: PathBuf,
        /// What was looked for.
        what: &'static str,
    },
    /// A CA certificate was refused as a trust anchor.
    #[error("{flag} {}: {source}", path.display())]
    Anchor {
        /// The flag that named the file.
        flag: &'static str,
        /// The file.
        path: PathBuf,
        /// Why rustls refused it.
        #[source]
        source: rustls::Error,
    },
    /// The client-certificate verifier could not be built from the CA file.
    #[error("--client-ca-file {}: {source}", path.display())]
    Verifier {
        /// The CA file.
        path: PathBuf,
        /// Why.
        #[source]
        source: rustls::server::VerifierBuilderError,
    },
    /// The certificate and key do not make a usable identity (they do not match, or
    /// the key type is unsupported).
    #[error("--tls-cert-file {} with --tls-key-file {}: {source}", cert.display(), key.display())]
    Identity {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// Why rustls refused them.
        #[source]
        source: rustls::Error,
    },
    /// The certificate file holds something that is not a usable certificate.
    #[error("{flag} {}: {problem}", path.display())]
    Invalid {
        /// The flag that named the file.
        flag: &'static str,
        /// The file.
        path: PathBuf,
        /// What is wrong.
        problem: String,
    },
    /// rustls refused the protocol versions of its own provider (never expected).
    #[error("TLS protocol versions: {0}")]
    Versions(#[source] rustls::Error),
    /// `--peer-server-name` is not a DNS name or IP address.
    #[error("--peer-server-name {name:?}: {source}")]
    ServerName {
        /// The name given.
        name: String,
        /// Why it is not a server name.
        #[source]
        source: rustls::pki_types::InvalidDnsNameError,
    },
    /// No `--peer-server-name`, and the serving certificate names no DNS SAN to use.
    #[error(
        "--tls-cert-file {}: {problem}; give --peer-server-name (the DNS name the replicas' certificate carries)",
        path.display()
    )]
    NoPeerServerName {
        /// The certificate file.
        path: PathBuf,
        /// Why no name came from it.
        problem: String,
    },
}

/// Why the extender refuses to listen as asked.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ListenError {
    /// Plain HTTP on an address other than loopback, without `--insecure-listen`.
    #[error(
        "--listen {addr}: plain HTTP on a non-loopback address is refused: anything that can reach it could POST /bind and place any pending pod on any node with tessera-scheduler's rights, bypassing taints, affinity and the admission policy. Give --tls-cert-file, --tls-key-file and --client-ca-file (mutual TLS), or listen on 127.0.0.1 beside kube-scheduler, or pass --insecure-listen to accept that risk"
    )]
    PlainOnNetwork {
        /// The address asked for.
        addr: SocketAddr,
    },
    /// Some of the three TLS files were given, not all.
    #[error(
        "mutual TLS needs --tls-cert-file, --tls-key-file and --client-ca-file together; missing {missing}"
    )]
    PartialTls {
        /// The flags not given.
        missing: String,
    },
    /// `--insecure-listen` together with the TLS files: one of them is a mistake.
    #[error(
        "--insecure-listen with --tls-cert-file: the extender serves mutual TLS; drop --insecure-listen"
    )]
    InsecureWithTls,
}

// === impl Transport ===

/// The files of the extender's mutual TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The serving certificate (chain), PEM; also presented as a client certificate
    /// when a follower hands a bind to the leader.
    pub cert: PathBuf,
    /// Its private key, PEM.
    pub key: PathBuf,
    /// The CA (bundle) that signs the clients' certificates, PEM.
    pub client_ca: PathBuf,
}

/// How the extender listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transport {
    /// HTTPS, client certificates required and verified; `bind` per [`BindAccess`].
    MutualTls(TlsFiles),
    /// Plain HTTP on a loopback address: only this pod's network namespace (or host)
    /// reaches it; every caller may call every verb.
    PlainLoopback,
    /// Plain HTTP on the network, as `--insecure-listen` asked: anyone who reaches it
    /// may bind.
    PlainInsecure,
}

/// Decides how to listen on `listen`, from the TLS files given and
/// `--insecure-listen`; refuses plain HTTP off loopback unless asked for.
pub fn choose_transport(
    listen: SocketAddr,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    client_ca: Option<PathBuf>,
    insecure: bool,
) -> Result<Transport, ListenError> {
    match (cert, key, client_ca) {
        (Some(cert), Some(key), Some(client_ca)) => {
            if insecure {
                return Err(ListenError::InsecureWithTls);
            }
            Ok(Transport::MutualTls(TlsFiles {
                cert,
                key,
                client_ca,
            }))
        }
        (None, None, None) if listen.ip().is_loopback() => Ok(Transport::PlainLoopback),
        (None, None, None) if insecure => Ok(Transport::PlainInsecure),
        (None, None, None) => Err(ListenError::PlainOnNetwork { addr: listen }),
        (cert, key, ca) => {
            let missing: Vec<&str> = [
                (cert.is_none(), "--tls-cert-file"),
                (key.is_none(), "--tls-key-file"),
                (ca.is_none(), "--client-ca-file"),
            ]
            .into_iter()
            .filter_map(|(absent, flag)| absent.then_some(flag))
            .collect();
            Err(ListenError::PartialTls {
                missing: missing.join(", "),
            })
        }
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read_certs(flag: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let read = |source| TlsError::Read {
        flag,
        path: path.to_owned(),
        source,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(read)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(read)?;
    if certs.is_empty() {
        return Err(TlsError::Empty {
            flag,
            path: path.to_owned(),
            what: "CERTIFICATE",
        });
    }
    Ok(certs)
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|source| match source {
        rustls::pki_types::pem::Error::NoItemsFound => TlsError::Empty {
            flag: "--tls-key-file",
            path: path.to_owned(),
            what: "PRIVATE KEY",
        },
        source => TlsError::Read {
            flag: "--tls-key-file",
            path: path.to_owned(),
            source,
        },
    })
}

fn roots(flag: &'static str, path: &Path) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in read_certs(flag, path)? {
        roots.add(cert).map_err(|source| TlsError::Anchor {
            flag,
            path: path.to_owned(),
            source,
        })?;
    }
    Ok(roots)
}

/// The server side: `files.cert` served, a client certificate signed by
/// `files.client_ca` required (no certificate, or another CA's: the handshake fails).
pub fn server_config(files: &TlsFiles) -> Result<Arc<ServerConfig>, TlsError> {
    let verifier = WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots("--client-ca-file", &files.client_ca)?),
        provider(),
    )
    .build()
    .map_err(|source| TlsError::Verifier {
        path: files.client_ca.clone(),
        source,
    })?;
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Versions)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(
            read_certs("--tls-cert-file", &files.cert)?,
            read_key(&files.key)?,
        )
        .map_err(|source| TlsError::Identity {
            cert: files.cert.clone(),
            key: files.key.clone(),
            source,
        })?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The client side of a follower handing a bind to the leader: it trusts
/// `peer_ca` for the leader's certificate and presents its own (`files.cert`).
pub fn peer_client_config(files: &TlsFiles, peer_ca: &Path) -> Result<ClientConfig, TlsError> {
    ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Versions)?
        .with_root_certificates(roots("--peer-ca-file", peer_ca)?)
        .with_client_auth_cert(
            read_certs("--tls-cert-file", &files.cert)?,
            read_key(&files.key)?,
        )
        .map_err(|source| TlsError::Identity {
            cert: files.cert.clone(),
            key: files.key.clone(),
            source,
        })
}

/// The name a follower verifies in the leader's certificate (the leader is dialled
/// by pod IP): `explicit`, else the first DNS SAN of the replicas' own certificate
/// (all replicas share it).
pub fn peer_server_name(
    explicit: Option<&str>,
    cert: &Path,
) -> Result<ServerName<'static>, TlsError> {
    let name = match explicit {
        Some(name) => name.to_owned(),
        None => {
            let no_name = |problem: String| TlsError::NoPeerServerName {
                path: cert.to_owned(),
                problem,
            };
            let first = read_certs("--tls-cert-file", cert)?
                .into_iter()
                .next()
                .ok_or_else(|| no_name("no certificate".into()))?;
            ClientIdentity::from_der(&first)
                .map_err(no_name)?
                .dns_names
                .into_iter()
                .next()
                .ok_or_else(|| no_name("it has no DNS subject alternative name".into()))?
        }
    };
    ServerName::try_from(name.clone()).map_err(|source| TlsError::ServerName { name, source })
}

// === impl ClientIdentity ===

/// Who a verified client certificate names.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClientIdentity {
    /// The subject's common names.
    pub common_names: Vec<String>,
    /// The DNS subject alternative names.
    pub dns_names: Vec<String>,
}

impl ClientIdentity {
    /// The names in a DER certificate; an error says why it could not be read.
    pub fn from_der(der: &[u8]) -> Result<Self, String> {
        let (_, cert) = x509_parser::parse_x509_certificate(der).map_err(|e| e.to_string())?;
        let common_names = cert
            .subject()
            .iter_common_name()
            .filter_map(|cn| cn.as_str().ok())
            .map(str::to_owned)
            .collect();
        let dns_names = cert
            .subject_alternative_name()
            .map_err(|e| e.to_string())?
            .map(|san| {
                san.value
                    .general_names
                    .iter()
                    .filter_map(|name| match name {
                        x509_parser::extensions::GeneralName::DNSName(dns) => {
                            Some((*dns).to_owned())
                        }
                        _ => None,
                    })
                    .collect()
            })
            .unwrap_or_default();
        Ok(Self {
            common_names,
            dns_names,
        })
    }

    /// Whether the certificate's CN or one of its DNS SANs is `name`.
    pub fn is(&self, name: &str) -> bool {
        self.common_names
            .iter()
            .chain(&self.dns_names)
            .any(|n| n == name)
    }
}

impl std::fmt::Display for ClientIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let cn = self.common_names.join(",");
        let dns = self.dns_names.join(",");
        write!(f, "CN={cn:?} DNS={dns:?}")
    }
}

// === impl BindAccess ===

/// Who may call `bind` over mutual TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BindAccess {
    /// Identities (CN or DNS SAN) that may bind: kube-scheduler's.
    pub bind_clients: Vec<String>,
    /// The replicas' own identity: may bind only a bind marked forwarded (a follower
    /// handing kube-scheduler's bind to the leader). `None`: followers cannot hand
    /// binds over.
    pub peer: Option<String>,
}

impl Default for BindAccess {
    fn default() -> Self {
        Self {
            bind_clients: vec![DEFAULT_BIND_CLIENT.to_owned()],
            peer: Some(DEFAULT_PEER_CLIENT.to_owned()),
        }
    }
}

/// Why a verified client's call is refused (HTTP 403).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// A client that is neither kube-scheduler nor a replica handing a bind over.
    #[error("client {identity} may not bind: only {allowed} may (--bind-client-name)")]
    NotBinder {
        /// Who the client is.
        identity: String,
        /// Who may bind.
        allowed: String,
    },
}

impl BindAccess {
    /// Whether `identity` may call the verb at `path`: every verb but `bind` is
    /// open to any verified client.
    pub fn authorize(
        &self,
        path: &str,
        forwarded: bool,
        identity: &ClientIdentity,
    ) -> Result<(), Refusal> {
        if verb(path) != "bind" {
            return Ok(());
        }
        if self.bind_clients.iter().any(|name| identity.is(name)) {
            return Ok(());
        }
        if forwarded && self.peer.as_deref().is_some_and(|peer| identity.is(peer)) {
            return Ok(());
        }
        Err(Refusal::NotBinder {
            identity: identity.to_string(),
            allowed: self.bind_clients.join(", "),
        })
    }
}

// === Serving ===

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

async fn accept(listener: &TcpListener) -> (TcpStream, SocketAddr) {
    loop {
        match listener.accept().await {
            Ok(accepted) => return accepted,
            Err(error) => {
                tracing::warn!(%error, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Serves the extender over mutual TLS on `listener` until the task is dropped:
/// each connection's client certificate is verified in the handshake, and each
/// request is checked against `access` before the extender sees it.
pub async fn serve_tls(
    listener: TcpListener,
    tls: Arc<ServerConfig>,
    extender: Extender,
    access: Arc<BindAccess>,
) {
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    let connections = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        // Accepted only while a slot is free: what waits beyond that waits in the
        // listen backlog, holding none of ours.
        let Ok(connection) = Arc::clone(&connections).acquire_owned().await else {
            return;
        };
        let (tcp, peer) = accept(&listener).await;
        let (acceptor, extender, access) =
            (acceptor.clone(), extender.clone(), Arc::clone(&access));
        tokio::spawn(async move {
            let _connection = connection;
            let handshaken = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await;
            let stream = match handshaken {
                Ok(Ok(stream)) => stream,
                Ok(Err(error)) => {
                    tracing::warn!(%peer, %error, "TLS handshake refused");
                    return;
                }
                Err(_) => {
                    tracing::warn!(%peer, "TLS handshake not finished in {HANDSHAKE_TIMEOUT:?}");
                    return;
                }
            };
            let identity = match stream
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|chain| chain.first())
                .map(|cert| ClientIdentity::from_der(cert))
            {
                Some(Ok(identity)) => identity,
                Some(Err(problem)) => {
                    tracing::warn!(%peer, %problem, "client certificate verified but unreadable: no identity");
                    ClientIdentity::default()
                }
                None => ClientIdentity::default(),
            };
            let identity = Arc::new(identity);
            let service = hyper::service::service_fn(move |request: Request<_>| {
                let (extender, access, identity) =
                    (extender.clone(), Arc::clone(&access), Arc::clone(&identity));
                async move {
                    let forwarded = request.headers().contains_key(FORWARDED_HEADER);
                    let path = request.uri().path().to_owned();
                    if let Err(refusal) = access.authorize(&path, forwarded, &identity) {
                        tracing::warn!(%peer, %path, %refusal, "call refused");
                        return Ok::<_, std::convert::Infallible>(text(
                            StatusCode::FORBIDDEN,
                            refusal.to_string(),
                        ));
                    }
                    Ok(extender.handle(request).await)
                }
            });
            let _ = crate::extender::http1_server()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await;
        });
    }
}

/// Serves kubelet's probes, plain HTTP, on `listener` until the task is dropped:
/// `GET /healthz` and `GET /readyz` only; every other request is 404.
pub async fn serve_probes(listener: TcpListener, extender: Extender) {
    loop {
        let (tcp, _) = accept(&listener).await;
        let extender = extender.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request: Request<_>| {
                let extender = extender.clone();
                async move {
                    let probe = request.method() == Method::GET
                        && matches!(request.uri().path(), "/healthz" | "/readyz");
                    Ok::<_, std::convert::Infallible>(if probe {
                        extender.handle(request).await
                    } else {
                        text(
                            StatusCode::NOT_FOUND,
                            "the probe port serves GET /healthz and /readyz only".into(),
                        )
                    })
                }
            });
            let _ = crate::extender::http1_server()
                .serve_connection(hyper_util::rt::TokioIo::new(tcp), service)
                .await;
        });
    }
}

#[cfg(test)]
mod tests;
