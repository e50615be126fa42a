//! kubelet's gRPC messages for node plugins, written as prost types from the
//! field numbers of kubelet's published API (k8s.io/kubelet, packages
//! `pluginregistration` and `k8s.io.kubelet.pkg.apis.dra.v1`), and the services
//! build.rs generates over them.

/// Plugin registration (`pluginregistration`, kubelet's plugin watcher).
pub mod registration {
    /// kubelet asks who the plugin is.
    #[derive(Clone, Copy, PartialEq, Eq, ::prost::Message)]
    pub struct InfoRequest {}

    /// Who the plugin is and where it serves.
    #[derive(Clone, PartialEq, Eq, ::prost::Message)]
    pub struct PluginInfo {
        /// `DRAPlugin`.
        #[prost(string, tag = "1")]
        pub r#type: String,
        /// The driver name.
        #[prost(string, tag = "2")]
        pub name: String,
        /// The DRA service's socket.
        #[prost(string, tag = "3")]
        pub endpoint: String,
        /// Services served there (`v1.DRAPlugin`).
        #[prost(string, repeated, tag = "4")]
        pub supported_versions: Vec<String>,
    }

    /// Whether kubelet registered the plugin.
    #[derive(Clone, PartialEq, Eq, ::prost::Message)]
    pub struct RegistrationStatus {
        /// Registered.
        #[prost(bool, tag = "1")]
        pub plugin_registered: bool,
        /// Why not, when not.
        #[prost(string, tag = "2")]
        pub error: String,
    }

    /// Empty.
    #[derive(Clone, Copy, PartialEq, Eq, ::prost::Message)]
    pub struct RegistrationStatusResponse {}

    #[allow(missing_debug_implementations, clippy::all)]
    mod services {
        include!(concat!(
            env!("OUT_DIR"),
            "/pluginregistration.Registration.rs"
        ));
    }
    pub use services::*;
}

/// kubelet's DRA plugin service, v1.
pub mod dra {
    use std::collections::HashMap;

    /// A ResourceClaim kubelet names.
    #[derive(Clone, PartialEq, Eq, ::prost::Message)]
    pub struct Claim {
        /// Its namespace.
        #[prost(string, tag = "1")]
        pub namespace: String,
        /// Its UID.
        #[prost(string, tag = "2")]
        pub uid: String,
        /// Its name.
        #[prost(string, tag = "3")]
        pub name: String,
    }

    /// Claims to prepare.
    #[derive(Clone, PartialEq, Eq, ::prost::Message)]
    pub struct NodePrepareResourcesRequest {
        /// The claims.
        #[prost(message, repeated, tag = "1")]
        pub claims: Vec<Claim>,
    }

    /// Per claim UID, what was prepared.
    #[derive(Clone, PartialEq, Eq, ::prost::Message)]
    pub struct NodePrepareResourcesResponse {
        /// Claim UID → result.
        #[prost(map = "string, message", tag = "1")]
        pub claims: HashMap<String, NodePrepareResourceResponse>,
    }

    /// One claim's devices, or why it was not prepared.
    #[derive(Clone, PartialEq, Eq, ::prost::Message)]
    pub struct NodePrepareResourceResponse {
        /// Its devices.
        #[prost(message, repeated, tag = "1")]
        pub devices: Vec<Device>,
        /// Non-empty: preparing failed.
        #[prost(string, tag = "2")]
        pub error: String,
    }

    /// One prepared device.
    #[derive(Clone, PartialEq, Eq, ::prost::Message)]
    pub struct Device {
        /// The claim's requests it serves (empty: all).
        #[prost(string, repeated, tag = "1")]
        pub request_names: Vec<String>,
        /// Its pool.
        #[prost(string, tag = "2")]
        pub pool_name: String,
        /// Its name.
        #[prost(string, tag = "3")]
        pub device_name: String,
        /// The CDI devices the runtime is to inject.
        #[prost(string, repeated, tag = "4")]
        pub cdi_device_ids: Vec<String>,
    }

    /// Claims to unprepare.
    #[derive(Clone, PartialEq, Eq, ::prost::Message)]
    pub struct NodeUnprepareResourcesRequest {
        /// The claims.
        #[prost(message, repeated, tag = "1")]
        pub claims: Vec<Claim>,
    }

    /// Per claim UID, whether it was unprepared.
    #[derive(Clone, PartialEq, Eq, ::prost::Message)]
    pub struct NodeUnprepareResourcesResponse {
        /// Claim UID → result.
        #[prost(map = "string, message", tag = "1")]
        pub claims: HashMap<String, NodeUnprepareResourceResponse>,
    }

    /// Non-empty error: unpreparing failed.
    #[derive(Clone, PartialEq, Eq, ::prost::Message)]
    pub struct NodeUnprepareResourceResponse {
        /// Why.
        #[prost(string, tag = "1")]
        pub error: String,
    }

    #[allow(missing_debug_implementations, clippy::all)]
    mod services {
        include!(concat!(
            env!("OUT_DIR"),
            "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin.rs"
        ));
    }
    /// The service's client (kubelet's side; tests play kubelet with it).
    pub use services::d_r_a_plugin_client as dra_plugin_client;
    /// The service's server, as tonic names it from `DRAPlugin`.
    pub use services::d_r_a_plugin_server as dra_plugin_server;
}

/// kubelet's DRA device-health service (`v1alpha1.DRAResourceHealth`, which
/// kubelet 1.36 calls on every registered DRA plugin): the plugin streams the
/// health of its devices, which kubelet shows in the pods' status
/// (`allocatedResourcesStatus`).
pub mod health {
    /// kubelet opens the stream.
    #[derive(Clone, Copy, PartialEq, Eq, ::prost::Message)]
    pub struct NodeWatchResourcesRequest {}

    /// A device of the driver.
    #[derive(Clone, PartialEq, Eq, ::prost::Message)]
    pub struct DeviceIdentifier {
        /// Its pool.
        #[prost(string, tag = "1")]
        pub pool_name: String,
        /// Its name.
        #[prost(string, tag = "2")]
        pub device_name: String,
    }

    /// A device's health.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, ::prost::Enumeration)]
    #[repr(i32)]
    pub enum HealthStatus {
        /// Cannot be told.
        Unknown = 0,
        /// Working.
        Healthy = 1,
        /// Reported a problem.
        Unhealthy = 2,
    }

    /// One device's health at a time.
    #[derive(Clone, PartialEq, Eq, ::prost::Message)]
    pub struct DeviceHealth {
        /// The device.
        #[prost(message, optional, tag = "1")]
        pub device: Option<DeviceIdentifier>,
        /// Its health.
        #[prost(enumeration = "HealthStatus", tag = "2")]
        pub health: i32,
        /// When it was determined, Unix seconds.
        #[prost(int64, tag = "3")]
        pub last_updated_time: i64,
        /// After how long without an update kubelet takes it as unknown.
        #[prost(int64, tag = "4")]
        pub health_check_timeout_seconds: i64,
    }

    /// Every device of the driver on the node.
    #[derive(Clone, PartialEq, Eq, ::prost::Message)]
    pub struct NodeWatchResourcesResponse {
        /// The devices.
        #[prost(message, repeated, tag = "1")]
        pub devices: Vec<DeviceHealth>,
    }

    #[allow(missing_debug_implementations, clippy::all)]
    mod services {
        include!(concat!(env!("OUT_DIR"), "/v1alpha1.DRAResourceHealth.rs"));
    }
    /// The service's client (kubelet's side; tests play kubelet with it).
    pub use services::d_r_a_resource_health_client as health_client;
    /// The service's server, as tonic names it from `DRAResourceHealth`.
    pub use services::d_r_a_resource_health_server as health_server;
}
