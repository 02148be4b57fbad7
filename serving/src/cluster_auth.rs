//! Internal authentication: only members of a cluster call its workers' internal RPCs.
//!
//! Every process of a cluster holds the cluster secret (the KV link's, `--kv-secret-file` /
//! `DUET_KV_SECRET`). From it each derives the same token, HMAC-SHA256(secret,
//! [`TOKEN_LABEL`]), which its calls to workers carry in [`TOKEN_HEADER`] and which a
//! worker's server checks, in constant time, on every call but `grpc.health.v1.Health`
//! (probes need no credentials). Reflection and `duet.v1.KvCache` sit behind the same check.
//!
//! Invariants: the token never equals nor reveals the secret (a derived key); a call
//! without the right token never reaches a service (`UNAUTHENTICATED` before routing); the
//! token is never logged (`Debug` is redacted). On a network others can read, serve TLS:
//! the token then travels encrypted, as API keys do.

use std::fmt;
use std::task::{Context, Poll};

use futures::future::{Either, Ready};
use subtle::ConstantTimeEq;
use tonic::metadata::{AsciiMetadataValue, MetadataValue};
use tonic::service::Interceptor;

use crate::error::ServeError;

/// The metadata key internal calls carry the token in.
pub const TOKEN_HEADER: &str = "x-duet-cluster-token";
/// What the token is derived with (a new label would be a new token).
pub const TOKEN_LABEL: &[u8] = b"duet internal rpc token/1";
/// Paths any caller may use: health, for probes and load balancers.
const OPEN_PREFIX: &str = "/grpc.health.v1.Health/";

/// The token of one cluster. Cheap to clone.
#[derive(Clone)]
pub struct ClusterToken {
    value: AsciiMetadataValue,
}

impl ClusterToken {
    /// The token of the key every member derives from the cluster secret with
    /// [`TOKEN_LABEL`] (kv-transfer's `SharedSecret::derive`, which the callers own: this
    /// crate, linked by the router too, does not link kv-transfer).
    pub fn from_key(key: [u8; 32]) -> Result<ClusterToken, ServeError> {
        let value = MetadataValue::try_from(hex::encode(key))
            .map_err(|e| ServeError::Auth(e.to_string()))?;
        Ok(ClusterToken { value })
    }

    /// Whether `presented` is this token (constant time in its content).
    pub fn accepts(&self, presented: &[u8]) -> bool {
        bool::from(self.value.as_bytes().ct_eq(presented))
    }

    /// Adds the token to an outgoing request's metadata.
    pub fn attach<T>(&self, req: &mut tonic::Request<T>) {
        req.metadata_mut().insert(TOKEN_HEADER, self.value.clone());
    }
}

impl fmt::Debug for ClusterToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClusterToken(<redacted>)")
    }
}

/// Client side: what a channel's calls carry. `None`: no token (only servers that check
/// nothing answer, e.g. the stand-in workers of `duet bench router`).
#[derive(Clone, Debug, Default)]
pub struct OutgoingToken(pub Option<ClusterToken>);

impl Interceptor for OutgoingToken {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(t) = &self.0 {
            t.attach(&mut req);
        }
        Ok(req)
    }
}

/// A channel to another duet process whose calls carry the cluster token.
pub type AuthChannel =
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, OutgoingToken>;

/// Server side: a layer that refuses every call without the token (health excepted).
/// `None` checks nothing (the router's public doors, which have API keys instead).
#[derive(Clone, Debug, Default)]
pub struct RequireToken {
    token: Option<ClusterToken>,
}

impl RequireToken {
    pub fn new(token: Option<ClusterToken>) -> RequireToken {
        RequireToken { token }
    }
}

impl<S> tower::Layer<S> for RequireToken {
    type Service = RequireTokenService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RequireTokenService {
            inner,
            token: self.token.clone(),
        }
    }
}

/// The service [`RequireToken`] makes.
#[derive(Clone, Debug)]
pub struct RequireTokenService<S> {
    inner: S,
    token: Option<ClusterToken>,
}

impl<S> RequireTokenService<S> {
    fn allowed<B>(&self, req: &http::Request<B>) -> bool {
        let Some(token) = &self.token else {
            return true;
        };
        req.uri().path().starts_with(OPEN_PREFIX)
            || req
                .headers()
                .get(TOKEN_HEADER)
                .is_some_and(|v| token.accepts(v.as_bytes()))
    }
}

impl<S, B, R> tower::Service<http::Request<B>> for RequireTokenService<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>>,
    R: Default,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Either<S::Future, Ready<Result<S::Response, S::Error>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        if self.allowed(&req) {
            return Either::Left(self.inner.call(req));
        }
        tracing::debug!(
            path = req.uri().path(),
            "internal call without the cluster token"
        );
        let status = tonic::Status::unauthenticated(
            "internal RPC: this worker answers only members of its cluster (the cluster token, \
             derived from the cluster secret, is missing or wrong)",
        );
        Either::Right(futures::future::ready(Ok(status.into_http())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(key: u8) -> ClusterToken {
        ClusterToken::from_key([key; 32]).unwrap()
    }

    #[test]
    fn members_agree_and_other_clusters_do_not() {
        let (a, a2, b) = (token(1), token(1), token(2));
        assert!(a.accepts(a2.value.as_bytes()));
        assert!(!a.accepts(b.value.as_bytes()));
        assert!(!a.accepts(b""));
        assert!(!a.accepts(&a.value.as_bytes()[1..]));
        assert!(!format!("{a:?}").contains(a.value.to_str().unwrap()));
    }

    #[derive(Clone)]
    struct Ok200;

    impl tower::Service<http::Request<()>> for Ok200 {
        type Response = http::Response<String>;
        type Error = std::convert::Infallible;
        type Future = Ready<Result<Self::Response, Self::Error>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, _: http::Request<()>) -> Self::Future {
            futures::future::ready(Ok(http::Response::new("served".into())))
        }
    }

    fn grpc_status(r: &http::Response<String>) -> Option<&str> {
        r.headers().get("grpc-status").and_then(|v| v.to_str().ok())
    }

    #[tokio::test]
    async fn calls_without_the_token_never_reach_the_service_but_health_does() {
        use tower::{Layer, ServiceExt};
        let t = token(1);
        let svc = RequireToken::new(Some(t.clone())).layer(Ok200);
        let call = |path: &str, tok: Option<&[u8]>| {
            let mut b = http::Request::builder().uri(format!("http://w{path}"));
            if let Some(tok) = tok {
                b = b.header(TOKEN_HEADER, tok);
            }
            svc.clone().oneshot(b.body(()).unwrap())
        };
        let r = call("/duet.v1.Decode/Generate", None).await.unwrap();
        assert_eq!(grpc_status(&r), Some("16"), "UNAUTHENTICATED");
        assert_eq!(r.body(), "");
        let wrong = token(2);
        let r = call("/duet.v1.KvCache/Subscribe", Some(wrong.value.as_bytes()))
            .await
            .unwrap();
        assert_eq!(grpc_status(&r), Some("16"));
        let r = call(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            None,
        )
        .await
        .unwrap();
        assert_eq!(grpc_status(&r), Some("16"), "reflection is internal too");
        let r = call("/duet.v1.Decode/Generate", Some(t.value.as_bytes()))
            .await
            .unwrap();
        assert_eq!(r.body(), "served");
        let r = call("/grpc.health.v1.Health/Check", None).await.unwrap();
        assert_eq!(r.body(), "served", "health stays open for probes");
        let open = RequireToken::new(None).layer(Ok200);
        let r = open
            .oneshot(
                http::Request::builder()
                    .uri("http://w/duet.v1.Generation/Generate")
                    .body(())
                    .unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(r.body(), "served");
    }
}
