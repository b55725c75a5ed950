//! TLS on Sluice's own listeners (`server.tls`): the HTTP API and Envoy's gRPC service,
//! with client certificates required when `client_ca_file` is set (mTLS).
//!
//! The files are read at start and again at every reload (a change to the config file,
//! to one of these files, or SIGHUP), so a rotated certificate is served to the next
//! connection without a restart; a reload whose files do not make a valid
//! configuration is refused and the certificate in force stays. Connections already
//! open keep the certificate they were made with.

use crate::config::ListenerTls;
use arc_swap::ArcSwap;
use rustls::ServerConfig;
use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use std::path::Path;
use std::sync::Arc;

/// Why the TLS files cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("server.tls.{what} {path}: {message}")]
    File { what: &'static str, path: String, message: String },
    #[error("server.tls: {0}")]
    Config(#[from] rustls::Error),
    #[error("server.tls.client_ca_file: {0}")]
    ClientCa(#[from] rustls::server::VerifierBuilderError),
    #[error("server.tls.client_san `{0}` is not a DNS name or an IP address ({1})")]
    ClientSan(String, String),
}

/// The TLS settings in force for each listener (ALPN differs: HTTP/1.1 and HTTP/2).
pub struct Tls {
    http: ArcSwap<ServerConfig>,
    grpc: ArcSwap<ServerConfig>,
}

impl Tls {
    /// Reads the files of `files`.
    pub fn load(files: &ListenerTls) -> Result<Self, TlsError> {
        let Read(http, grpc) = Self::read(files)?;
        Ok(Self { http: ArcSwap::from_pointee(http), grpc: ArcSwap::from_pointee(grpc) })
    }

    /// Reads the files (again, at a reload), for [`Tls::install`] once the rest of the
    /// reload holds too: the two listeners' configurations.
    pub fn read(files: &ListenerTls) -> Result<Read, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&files.cert_file)
            .and_then(|certs| certs.collect())
            .map_err(|e| file_error("cert_file", &files.cert_file, e))?;
        if certs.is_empty() {
            return Err(file_error("cert_file", &files.cert_file, "no PEM certificate in it"));
        }
        let key =
            PrivateKeyDer::from_pem_file(&files.key_file).map_err(|e| file_error("key_file", &files.key_file, e))?;
        let builder = ServerConfig::builder_with_provider(provider.clone()).with_safe_default_protocol_versions()?;
        let builder = match &files.client_ca_file {
            Some(path) => {
                let mut roots = rustls::RootCertStore::empty();
                for ca in CertificateDer::pem_file_iter(path).map_err(|e| file_error("client_ca_file", path, e))? {
                    roots.add(ca.map_err(|e| file_error("client_ca_file", path, e))?)?;
                }
                let verifier =
                    rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider).build()?;
                match &files.client_san {
                    None => builder.with_client_cert_verifier(verifier),
                    Some(san) => {
                        let name = ServerName::try_from(san.clone())
                            .map_err(|e| TlsError::ClientSan(san.clone(), e.to_string()))?;
                        builder.with_client_cert_verifier(Arc::new(NamedClient { inner: verifier, name }))
                    }
                }
            }
            None => builder.with_no_client_auth(),
        };
        let mut http = builder.with_single_cert(certs, key)?;
        let mut grpc = http.clone();
        http.alpn_protocols = vec![b"http/1.1".to_vec()];
        grpc.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Read(http, grpc))
    }

    /// Puts files read by [`Tls::read`] in force for new connections.
    pub fn install(&self, Read(http, grpc): Read) {
        self.http.store(Arc::new(http));
        self.grpc.store(Arc::new(grpc));
    }

    /// An acceptor for the next HTTP connection.
    pub fn http(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(self.http.load_full())
    }

    /// An acceptor for the next gRPC connection.
    pub fn grpc(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(self.grpc.load_full())
    }
}

/// A client certificate verifier that also requires the certificate to be valid for
/// `name` (`server.tls.client_san`): the CA's verdict first, then the name.
#[derive(Debug)]
struct NamedClient {
    inner: Arc<dyn ClientCertVerifier>,
    name: ServerName<'static>,
}

impl ClientCertVerifier for NamedClient {
    fn offer_client_auth(&self) -> bool {
        self.inner.offer_client_auth()
    }

    fn client_auth_mandatory(&self) -> bool {
        self.inner.client_auth_mandatory()
    }

    fn root_hint_subjects(&self) -> &[rustls::DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: rustls::pki_types::UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let verified = self.inner.verify_client_cert(end_entity, intermediates, now)?;
        let bad = |e: rustls::CertificateError| rustls::Error::InvalidCertificate(e);
        let cert =
            webpki::EndEntityCert::try_from(end_entity).map_err(|_| bad(rustls::CertificateError::BadEncoding))?;
        cert.verify_is_valid_for_subject_name(&self.name)
            .map_err(|_| bad(rustls::CertificateError::NotValidForName))?;
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// A client's TLS settings: the servers verified against `ca_file` (or the system's
/// roots), the certificate `cert_file` and its key presented when set.
fn client_config(
    ca_file: &Option<std::path::PathBuf>,
    cert_file: &Option<std::path::PathBuf>,
    key_file: &Option<std::path::PathBuf>,
) -> Result<rustls::ClientConfig, String> {
    let mut roots = rustls::RootCertStore::empty();
    match ca_file {
        Some(path) => {
            for ca in CertificateDer::pem_file_iter(path).map_err(|e| format!("ca_file {}: {e}", path.display()))? {
                roots.add(ca.map_err(|e| format!("ca_file {}: {e}", path.display()))?).map_err(|e| e.to_string())?;
            }
        }
        None => {
            roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots);
    match (cert_file, key_file) {
        (Some(cert), Some(key)) => {
            let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
                .and_then(|c| c.collect())
                .map_err(|e| format!("cert_file {}: {e}", cert.display()))?;
            let key = PrivateKeyDer::from_pem_file(key).map_err(|e| format!("key_file {}: {e}", key.display()))?;
            builder.with_client_auth_cert(certs, key).map_err(|e| e.to_string())
        }
        (None, None) => Ok(builder.with_no_client_auth()),
        _ => Err("cert_file and key_file go together: set both, or neither".into()),
    }
}

/// What connects the memcached store to its servers over TLS (`store.tls` of a
/// memcached store; envoyproxy/ratelimit's `MEMCACHE_TLS`): TCP to `host:port`, then TLS
/// verifying the server by its host.
pub fn memcached_connector(files: &crate::config::TlsConfig) -> Result<sluice::store::MemcachedConnector, String> {
    let config = client_config(&files.ca_file, &files.cert_file, &files.key_file)?;
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    Ok(Arc::new(move |addr: String| {
        let connector = connector.clone();
        Box::pin(async move {
            let host = addr.rsplit_once(':').map_or(addr.as_str(), |(h, _)| h);
            let host = host.trim_start_matches('[').trim_end_matches(']').to_string();
            let name = ServerName::try_from(host).map_err(std::io::Error::other)?;
            let tcp = tokio::net::TcpStream::connect(&addr).await?;
            tcp.set_nodelay(true)?;
            let tls: Box<dyn sluice::store::MemcachedIo> = Box::new(connector.connect(name, tcp).await?);
            Ok(tls)
        })
    }))
}

/// TLS files read, not yet in force.
pub struct Read(ServerConfig, ServerConfig);

fn file_error(what: &'static str, path: &Path, e: impl std::fmt::Display) -> TlsError {
    TlsError::File { what, path: path.display().to_string(), message: e.to_string() }
}

/// What connects a gRPC client over TLS (the xDS client, `xds.tls`): TCP to the URI's
/// host, then TLS verifying `server_name` against `files.ca_file` (or the system's
/// roots), presenting the client certificate when one is set, offering HTTP/2.
pub fn client_connector(
    files: &crate::config::XdsTls,
    server_name: &str,
) -> Result<
    impl tower::Service<
        axum::http::Uri,
        Response = hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>,
        Error = std::io::Error,
        Future = impl Send,
    > + Clone
    + Send
    + 'static,
    String,
> {
    let mut config = client_config(&files.ca_file, &files.cert_file, &files.key_file)?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let name = rustls::pki_types::ServerName::try_from(server_name.to_string())
        .map_err(|e| format!("server name {server_name}: {e}"))?;
    Ok(tower::service_fn(move |uri: axum::http::Uri| {
        let (connector, name) = (connector.clone(), name.clone());
        async move {
            let host = uri.host().unwrap_or_default().trim_start_matches('[').trim_end_matches(']').to_string();
            let tcp = tokio::net::TcpStream::connect((host, uri.port_u16().unwrap_or(443))).await?;
            tcp.set_nodelay(true)?;
            Ok(hyper_util::rt::TokioIo::new(connector.connect(name, tcp).await?))
        }
    }))
}
