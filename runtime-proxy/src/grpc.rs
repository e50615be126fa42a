//! gRPC over HTTP/2 details the proxy needs without a codec: message framing,
//! status headers, and the `grpc-timeout` deadline.

use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderValue, Response};
use percent_encoding::percent_decode_str;
use tonic::Code;

use crate::body::{ProxyBody, empty_body};

/// Length of the gRPC message prefix: one flag byte and a big-endian u32 length.
const PREFIX_LEN: usize = 5;

/// Why a request or response body is not exactly one uncompressed gRPC message.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FrameError {
    /// The body ended inside the 5-byte message prefix.
    #[error("gRPC frame truncated: {0} bytes, shorter than the 5-byte message prefix")]
    ShortPrefix(usize),
    /// The prefix announced more bytes than the body holds.
    #[error("gRPC frame truncated: prefix announces {announced} bytes, body holds {held}")]
    ShortMessage { announced: usize, held: usize },
    /// Bytes follow the first message of a unary call.
    #[error("gRPC body holds {0} bytes after its first message; a unary call carries exactly one")]
    TrailingBytes(usize),
    /// The compressed flag is set; the proxy must read the message to run hooks.
    #[error("compressed gRPC message (flag {0}) on an intercepted method; send it uncompressed")]
    Compressed(u8),
}

/// Returns the single message carried by a unary gRPC body.
pub fn decode_frame(body: &[u8]) -> Result<&[u8], FrameError> {
    let Some((prefix, rest)) = body.split_first_chunk::<PREFIX_LEN>() else {
        return Err(FrameError::ShortPrefix(body.len()));
    };
    if prefix[0] != 0 {
        return Err(FrameError::Compressed(prefix[0]));
    }
    let announced = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
    if rest.len() < announced {
        return Err(FrameError::ShortMessage {
            announced,
            held: rest.len(),
        });
    }
    if rest.len() > announced {
        return Err(FrameError::TrailingBytes(rest.len() - announced));
    }
    Ok(rest)
}

/// Frames one uncompressed message.
pub fn encode_frame(message: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(PREFIX_LEN + message.len());
    out.put_u8(0);
    // CRI messages are far below 4 GiB; the body limit rejects anything larger first.
    out.put_u32(u32::try_from(message.len()).unwrap_or(u32::MAX));
    out.put_slice(message);
    out.freeze()
}

/// `message` as a `grpc-message` value: percent-encoded where gRPC says.
pub use tessera_http2::encode_grpc_message as encode_message;

/// A trailers-only gRPC response carrying `code` and `message`, as a gRPC server
/// sends when it fails a call before any message.
pub fn status_response(code: Code, message: &str) -> Response<ProxyBody> {
    let mut response = Response::new(empty_body());
    let headers = response.headers_mut();
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    headers.insert("grpc-status", HeaderValue::from(code as i32));
    if let Ok(value) = HeaderValue::from_str(&encode_message(message)) {
        headers.insert("grpc-message", value);
    }
    response
}

/// The `grpc-status` in a header or trailer map, if any.
pub fn status_code(map: &HeaderMap) -> Option<Code> {
    let value = map.get("grpc-status")?.to_str().ok()?.parse::<i32>().ok()?;
    Some(Code::from_i32(value))
}

/// The decoded `grpc-message`, if any.
pub fn status_message(map: &HeaderMap) -> Option<String> {
    let value = map.get("grpc-message")?.to_str().ok()?;
    Some(percent_decode_str(value).decode_utf8_lossy().into_owned())
}

/// The status of a finished call: from the trailers, or from the headers of a
/// trailers-only response; `Unknown` when neither carries one.
pub fn call_status(headers: &HeaderMap, trailers: Option<&HeaderMap>) -> (Code, String) {
    let code = trailers
        .and_then(status_code)
        .or_else(|| status_code(headers))
        .unwrap_or(Code::Unknown);
    let message = trailers
        .and_then(status_message)
        .or_else(|| status_message(headers))
        .unwrap_or_default();
    (code, message)
}

/// Why a `grpc-timeout` header could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid grpc-timeout header {0:?}: expected 1-8 digits and a unit of H, M, S, m, u or n")]
pub struct TimeoutError(pub String);

/// Parses a `grpc-timeout` header value (gRPC over HTTP/2 spec).
pub fn parse_timeout(value: &str) -> Result<Duration, TimeoutError> {
    let bad = || TimeoutError(value.to_owned());
    if value.len() < 2 || value.len() > 9 || !value.is_ascii() {
        return Err(bad());
    }
    let (digits, unit) = value.split_at(value.len() - 1);
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let amount: u64 = digits.parse().map_err(|_| bad())?;
    let duration = match unit {
        "H" => Duration::from_secs(amount * 3600),
        "M" => Duration::from_secs(amount * 60),
        "S" => Duration::from_secs(amount),
        "m" => Duration::from_millis(amount),
        "u" => Duration::from_micros(amount),
        "n" => Duration::from_nanos(amount),
        _ => return Err(bad()),
    };
    Ok(duration)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_roundtrip() {
        let framed = encode_frame(b"hello");
        assert_eq!(&framed[..5], &[0, 0, 0, 0, 5]);
        assert_eq!(decode_frame(&framed), Ok(&b"hello"[..]));
    }

    #[test]
    fn frame_errors_name_the_problem() {
        assert_eq!(decode_frame(&[0, 0]), Err(FrameError::ShortPrefix(2)));
        assert_eq!(
            decode_frame(&[0, 0, 0, 0, 9, 1]),
            Err(FrameError::ShortMessage {
                announced: 9,
                held: 1
            })
        );
        assert_eq!(
            decode_frame(&[0, 0, 0, 0, 1, 1, 2]),
            Err(FrameError::TrailingBytes(1))
        );
        assert_eq!(
            decode_frame(&[1, 0, 0, 0, 0]),
            Err(FrameError::Compressed(1))
        );
        assert_eq!(decode_frame(&[0, 0, 0, 0, 0]), Ok(&b""[..]));
    }

    #[test]
    fn timeouts() {
        assert_eq!(parse_timeout("2S"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_timeout("150m"), Ok(Duration::from_millis(150)));
        assert_eq!(
            parse_timeout("99999999n"),
            Ok(Duration::from_nanos(99_999_999))
        );
        assert!(parse_timeout("S").is_err());
        assert!(parse_timeout("123456789S").is_err());
        assert!(parse_timeout("1x").is_err());
        assert!(parse_timeout("-1S").is_err());
    }

    #[test]
    fn status_response_encodes_message() {
        let response = status_response(Code::Unavailable, "down 100%\nnow");
        assert_eq!(status_code(response.headers()), Some(Code::Unavailable));
        assert_eq!(
            response.headers()["grpc-message"].to_str().ok(),
            Some("down 100%25%0Anow")
        );
        assert_eq!(
            status_message(response.headers()).as_deref(),
            Some("down 100%\nnow")
        );
    }
}
