//! A kube client from `--kubeconfig` or the usual places: the binaries' one way in.
//! Behind the `client` feature so the rest of this crate stays free of I/O.

use std::path::Path;

/// Why no client could be built.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The kubeconfig file could not be read or parsed.
    #[error("reading kubeconfig {path}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: kube::config::KubeconfigError,
    },
    /// The kubeconfig does not describe a usable cluster.
    #[error("kubeconfig {path}")]
    Config {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: kube::config::KubeconfigError,
    },
    /// No kubeconfig was found and this is not a pod in a cluster.
    #[error("no kubeconfig found ($KUBECONFIG, ~/.kube/config) and not running in a cluster")]
    Infer(#[source] kube::config::InferConfigError),
    /// The client could not be built from the configuration.
    #[error("building the Kubernetes client")]
    Build(#[source] kube::Error),
}

/// A client from `kubeconfig` when given, else `$KUBECONFIG`, `~/.kube/config` or in-cluster.
pub async fn kube_client(kubeconfig: Option<&Path>) -> Result<kube::Client, ClientError> {
    let config = match kubeconfig {
        Some(path) => {
            let shown = path.display().to_string();
            let file =
                kube::config::Kubeconfig::read_from(path).map_err(|source| ClientError::Read {
                    path: shown.clone(),
                    source,
                })?;
            kube::Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|source| ClientError::Config {
                    path: shown,
                    source,
                })?
        }
        None => kube::Config::infer().await.map_err(ClientError::Infer)?,
    };
    kube::Client::try_from(config).map_err(ClientError::Build)
}
