//! Errors in OpenAI's JSON shape (`{"error": {"message", "type", "param", "code"}}`) with
//! the HTTP status of their class: 400 bad parameters, 404 unknown model, 429 queue full
//! (with `Retry-After`), 503 no workers, 504 deadline, 500 otherwise. The class comes from
//! the same classification the gRPC door uses.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use duet_engine::ErrorClass;

use crate::error::RouterError;

/// An error answer of the HTTP door.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<String>,
    /// Seconds for `Retry-After` (429).
    pub retry_after: Option<u64>,
}

/// The HTTP status of an error class ([`ErrorClass::http_status`]).
pub fn http_status(class: ErrorClass) -> StatusCode {
    StatusCode::from_u16(class.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}

impl ApiError {
    /// A 400 naming the offending parameter.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: Some(param.to_string()),
            retry_after: None,
        }
    }

    /// From a gRPC status (what the relay reports once a request was admitted).
    pub fn from_status(s: &tonic::Status) -> Self {
        let class = duet_serving::status::class_of(s.code());
        let retry_after = s
            .metadata()
            .get("retry-after-ms")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
            .map(|ms| ms.div_ceil(1000).max(1));
        let status = http_status(class);
        ApiError {
            status,
            message: s.message().to_string(),
            param: None,
            retry_after,
        }
    }

    /// OpenAI's `type` for this status.
    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::UNAUTHORIZED => "authentication_error",
            s if s.is_client_error() => "invalid_request_error",
            StatusCode::SERVICE_UNAVAILABLE => "service_unavailable_error",
            StatusCode::GATEWAY_TIMEOUT => "timeout_error",
            _ => "internal_error",
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind(),
                "param": self.param,
                "code": self.status.as_u16(),
            }
        })
    }
}

impl From<RouterError> for ApiError {
    fn from(e: RouterError) -> Self {
        let param = match &e {
            RouterError::Invalid { field, .. } => Some((*field).to_string()),
            RouterError::UnknownModel(_) => Some("model".to_string()),
            _ => None,
        };
        let retry_after = match &e {
            RouterError::QueueFull { retry_after_ms, .. } => {
                Some(retry_after_ms.div_ceil(1000).max(1))
            }
            _ => None,
        };
        let status = http_status(e.class());
        ApiError {
            status,
            message: e.to_string(),
            param,
            retry_after,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(self.body())).into_response();
        // A 429 always says when to come back (1 s unless the cause gave a hint).
        let retry_after = self
            .retry_after
            .or((self.status == StatusCode::TOO_MANY_REQUESTS).then_some(1));
        if self.status == StatusCode::UNAUTHORIZED {
            r.headers_mut()
                .insert("www-authenticate", HeaderValue::from_static("Bearer"));
        }
        if let Some(s) = retry_after {
            if let Ok(v) = HeaderValue::from_str(&s.to_string()) {
                r.headers_mut().insert("retry-after", v);
            }
        }
        r
    }
}
