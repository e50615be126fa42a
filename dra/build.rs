//! kubelet's plugin-registration and DRA gRPC services, generated from Rust
//! message types (src/proto.rs) with tonic's manual builder: no published crate
//! carries these APIs, and no .proto file is copied in.
use tonic_build::manual::{Builder, Method, Service};

fn method(name: &str, route: &str, input: &str, output: &str) -> Method {
    Method::builder()
        .name(name)
        .route_name(route)
        .input_type(input)
        .output_type(output)
        .codec_path("tonic_prost::ProstCodec")
        .build()
}

fn main() {
    let registration = Service::builder()
        .name("Registration")
        .package("pluginregistration")
        .method(method(
            "get_info",
            "GetInfo",
            "crate::proto::registration::InfoRequest",
            "crate::proto::registration::PluginInfo",
        ))
        .method(method(
            "notify_registration_status",
            "NotifyRegistrationStatus",
            "crate::proto::registration::RegistrationStatus",
            "crate::proto::registration::RegistrationStatusResponse",
        ))
        .build();
    let dra = Service::builder()
        .name("DRAPlugin")
        .package("k8s.io.kubelet.pkg.apis.dra.v1")
        .method(method(
            "node_prepare_resources",
            "NodePrepareResources",
            "crate::proto::dra::NodePrepareResourcesRequest",
            "crate::proto::dra::NodePrepareResourcesResponse",
        ))
        .method(method(
            "node_unprepare_resources",
            "NodeUnprepareResources",
            "crate::proto::dra::NodeUnprepareResourcesRequest",
            "crate::proto::dra::NodeUnprepareResourcesResponse",
        ))
        .build();
    let health = Service::builder()
        .name("DRAResourceHealth")
        .package("v1alpha1")
        .method(
            Method::builder()
                .name("node_watch_resources")
                .route_name("NodeWatchResources")
                .input_type("crate::proto::health::NodeWatchResourcesRequest")
                .output_type("crate::proto::health::NodeWatchResourcesResponse")
                .codec_path("tonic_prost::ProstCodec")
                .server_streaming()
                .build(),
        )
        .build();
    Builder::new()
        .build_transport(false)
        .compile(&[registration, dra, health]);
}
