//! Routing and handlers for the Kubernetes API paths.

use std::collections::HashMap;
use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::StreamingLists;
use crate::object::{self, StoredObject};
use crate::resource::{ResourceType, Verb};
use crate::rv::{self, RvParam};
use crate::selectors::{FieldSelector, LabelSelector, ShardSelector};
use crate::shared::Shared;
use crate::state::{Filter, Page};
use crate::status::{ApiError, FieldError, invalid_list_options, json_response};
use crate::{admin, watch};

/// Parsed query string.
pub(crate) type Params = HashMap<String, String>;

/// The router: everything goes through one fallback handler that parses paths itself.
pub(crate) fn router(shared: Arc<Shared>) -> Router {
    Router::new().fallback(dispatch).with_state(shared)
}

/// What a request path designates.
#[derive(Debug)]
enum Target {
    Collection { ty: usize, ns: Option<String> },
    Object { ty: usize, ns: String, name: String },
}

fn not_found_path(path: &str) -> ApiError {
    ApiError::new(
        404,
        "NotFound",
        format!("the server could not find the requested resource ({path})"),
    )
}

fn authorized(shared: &Shared, headers: &HeaderMap) -> bool {
    let Some(token) = &shared.opts.token else {
        return true;
    };
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|t| t.trim() == token)
}

async fn dispatch(
    State(shared): State<Arc<Shared>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let res = handle(shared.clone(), method, uri, &headers, body).await;
    if shared.opts.gzip
        && accepts_gzip(&headers)
        && res.extensions().get::<watch::WatchStream>().is_none()
        && res.extensions().get::<HeldPage>().is_none()
    {
        gzip(res, shared.opts.gzip_min_bytes).await
    } else {
        res
    }
}

async fn handle(
    shared: Arc<Shared>,
    method: Method,
    uri: Uri,
    headers: &HeaderMap,
    body: Bytes,
) -> Response {
    if !authorized(&shared, headers) {
        return ApiError::new(401, "Unauthorized", "Unauthorized").into_response();
    }
    let params: Params = match Query::try_from_uri(&uri) {
        Ok(Query(p)) => p,
        Err(e) => {
            return ApiError::bad_request(format!("invalid query string: {e}")).into_response();
        }
    };
    let path = uri.path();
    if path.starts_with("/testkit/") {
        return admin::handle(shared, &method, path, &params).await;
    }
    match api(shared, &method, path, &params, headers, body).await {
        Ok(res) => res,
        Err(e) => e.into_response(),
    }
}

/// Whether `Accept-Encoding` lists `gzip` (kube-apiserver's `negotiateContentEncoding`).
fn accepts_gzip(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT_ENCODING)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|token| {
            let name = token.split(';').next().unwrap_or("").trim();
            name.eq_ignore_ascii_case("gzip")
        })
}

/// gzip-compresses a buffered response (`Content-Encoding: gzip`, `Vary: Accept-Encoding`).
async fn gzip(res: Response, min_bytes: usize) -> Response {
    use std::io::Write;
    let (mut parts, body) = res.into_parts();
    let bytes = match axum::body::to_bytes(body, usize::MAX).await {
        Ok(b) => b,
        Err(e) => {
            return ApiError::new(500, "InternalError", format!("cannot buffer response: {e}"))
                .into_response();
        }
    };
    if bytes.len() < min_bytes {
        return Response::from_parts(parts, Body::from(bytes));
    }
    let mut enc = flate2::write::GzEncoder::new(
        Vec::with_capacity(bytes.len() / 4 + 64),
        flate2::Compression::fast(),
    );
    let compressed = match enc.write_all(&bytes).and_then(|()| enc.finish()) {
        Ok(c) => c,
        Err(_) => return Response::from_parts(parts, Body::from(bytes)),
    };
    parts.headers.remove(header::CONTENT_LENGTH);
    parts
        .headers
        .insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
    parts
        .headers
        .append(header::VARY, HeaderValue::from_static("Accept-Encoding"));
    Response::from_parts(parts, Body::from(compressed))
}

fn resolve(shared: &Shared, path: &str) -> Result<Target, ApiError> {
    let segs: Vec<&str> = path
        .trim_start_matches('/')
        .trim_end_matches('/')
        .split('/')
        .collect();
    let (group, version, rest) = match segs.as_slice() {
        ["api", version, rest @ ..] => ("", *version, rest),
        ["apis", group, version, rest @ ..] => (*group, *version, rest),
        _ => return Err(not_found_path(path)),
    };
    let st = shared.state();
    let find = |plural: &str| {
        st.lookup(group, version, plural)
            .ok_or_else(|| not_found_path(path))
    };
    let scoped = |ty: usize| st.resource_type(ty).namespaced;
    let target = match rest {
        [plural] => Target::Collection {
            ty: find(plural)?,
            ns: None,
        },
        [plural, name] => {
            let ty = find(plural)?;
            if scoped(ty) || name.is_empty() {
                return Err(not_found_path(path));
            }
            Target::Object {
                ty,
                ns: String::new(),
                name: name.to_string(),
            }
        }
        ["namespaces", ns, plural] => {
            let ty = find(plural)?;
            if !scoped(ty) || ns.is_empty() {
                return Err(not_found_path(path));
            }
            Target::Collection {
                ty,
                ns: Some(ns.to_string()),
            }
        }
        ["namespaces", ns, plural, name] => {
            let ty = find(plural)?;
            if !scoped(ty) || ns.is_empty() || name.is_empty() {
                return Err(not_found_path(path));
            }
            Target::Object {
                ty,
                ns: ns.to_string(),
                name: name.to_string(),
            }
        }
        _ => return Err(not_found_path(path)),
    };
    Ok(target)
}

/// Parses a boolean query parameter (`true`/`1`/`false`/`0`; empty counts as absent).
pub(crate) fn parse_bool(params: &Params, key: &str) -> Result<Option<bool>, ApiError> {
    match params.get(key).map(String::as_str) {
        None | Some("") => Ok(None),
        Some("true" | "1") => Ok(Some(true)),
        Some("false" | "0") => Ok(Some(false)),
        Some(other) => Err(ApiError::bad_request(format!(
            "invalid value for {key}: {other:?}"
        ))),
    }
}

fn is_watch(params: &Params) -> bool {
    params.get("watch").is_some_and(|w| w == "true" || w == "1")
}

/// Whether the client asked for `PartialObjectMetadata(List)`.
fn wants_metadata(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("as=PartialObjectMetadata"))
}

async fn api(
    shared: Arc<Shared>,
    method: &Method,
    path: &str,
    params: &Params,
    headers: &HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let target = resolve(&shared, path)?;
    let verb = match (&target, method) {
        (Target::Collection { .. }, &Method::GET) if is_watch(params) => Verb::Watch,
        (Target::Collection { .. }, &Method::GET) => Verb::List,
        (Target::Collection { .. }, &Method::POST) => Verb::Create,
        (Target::Object { .. }, &Method::GET) => Verb::Get,
        (Target::Object { .. }, &Method::PUT) => Verb::Update,
        (Target::Object { .. }, &Method::DELETE) => Verb::Delete,
        (Target::Object { .. }, &Method::PATCH) => Verb::Patch,
        _ => {
            return Err(ApiError::new(
                405,
                "MethodNotAllowed",
                format!(
                    "the server does not allow this method on the requested resource ({method} {path})"
                ),
            ));
        }
    };
    let named = verb == Verb::List
        && FieldSelector::parse(params.get("fieldSelector").map_or("", |s| s))
            .is_ok_and(|f| f.names_one());
    // A narrowed LIST is in flight until its answer is built (the guard's owner outlives it).
    let counted = shared.clone();
    let _in_flight = named.then(|| counted.counters.named_list_in_flight());
    let (mut ignore_fields, mut stale_at) = (false, None);
    if named {
        shared.counters.incr_list_named();
        let (failure, delay) = {
            let mut f = shared.faults();
            ignore_fields = f.ignores_named_field_selector();
            stale_at = f.named_lists_at();
            (f.take_named_list_failure(), f.named_list_delay())
        };
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        if let Some(err) = failure {
            return Err(err);
        }
    } else if verb == Verb::List && params.get("limit").map(String::as_str) == Some("1") {
        shared.counters.incr_list_one();
    } else {
        shared.counters.incr(verb);
    }
    if let Some(err) = shared.faults().take_failure(verb) {
        return Err(err);
    }
    let meta_only = wants_metadata(headers);
    if verb == Verb::List
        && meta_only
        && let Some(err) = shared.faults().metadata_list_failure()
    {
        return Err(err);
    }
    match target {
        Target::Collection { ty, ns } => {
            let filter = Filter {
                namespace: ns.clone(),
                labels: LabelSelector::parse(params.get("labelSelector").map_or("", |s| s))?,
                fields: match params.get("fieldSelector") {
                    // `Faults::ignore_named_field_selector`: as if there were none.
                    Some(_) if ignore_fields => FieldSelector::default(),
                    Some(s) => FieldSelector::parse(s)?,
                    None => FieldSelector::default(),
                },
                // Without the feature gate the parameter is ignored entirely, even when
                // malformed (a full list, no shardInfo).
                shard: match params.get("shardSelector") {
                    Some(s) if shared.opts.sharded_list_and_watch => Some(ShardSelector::parse(s)?),
                    _ => None,
                },
            };
            if let Some(field) = filter.fields.kind_specific() {
                let kind = shared.state().resource_type(ty).kind.clone();
                if kind != "Pod" {
                    return Err(ApiError::bad_request(format!(
                        "field label not supported: {field}"
                    )));
                }
            }
            match verb {
                Verb::Watch => watch::start(shared, ty, filter, params, meta_only).await,
                Verb::List => list(shared, ty, filter, params, meta_only, stale_at).await,
                _ => create(&shared, ty, ns.as_deref(), &body),
            }
        }
        Target::Object { ty, ns, name } => match verb {
            Verb::Get => {
                let (obj, rt) = {
                    let st = shared.state();
                    (st.get(ty, &ns, &name), st.resource_type(ty).clone())
                };
                let obj = obj.ok_or_else(|| ApiError::not_found(&rt.qualified(), &name))?;
                Ok(json_response(
                    StatusCode::OK,
                    render(&obj, meta_only).to_vec(),
                ))
            }
            Verb::Update => replace(&shared, ty, &ns, &name, &body),
            Verb::Patch => patch(&shared, ty, &ns, &name, headers, &body),
            _ => {
                let (obj, rt) =
                    shared.write(|st| (st.delete(ty, &ns, &name), st.resource_type(ty).clone()));
                let obj = obj.ok_or_else(|| ApiError::not_found(&rt.qualified(), &name))?;
                Ok(json_response(StatusCode::OK, obj.json.to_vec()))
            }
        },
    }
}

fn parse_body(body: &Bytes) -> Result<Value, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))
}

fn create(
    shared: &Shared,
    ty: usize,
    ns: Option<&str>,
    body: &Bytes,
) -> Result<Response, ApiError> {
    let rt = shared.state().resource_type(ty).clone();
    let p = object::prepare(&rt, parse_body(body)?, ns)?;
    let obj = shared.write(|st| st.create(ty, p))?;
    Ok(json_response(StatusCode::CREATED, obj.json.to_vec()))
}

fn replace(
    shared: &Shared,
    ty: usize,
    ns: &str,
    name: &str,
    body: &Bytes,
) -> Result<Response, ApiError> {
    replace_with(shared, ty, ns, name, parse_body(body)?)
}

/// Replaces object `ns/name` of type `ty` with `value` (its resourceVersion, if any, must
/// be the stored one), refusing a body that names another object.
fn replace_with(
    shared: &Shared,
    ty: usize,
    ns: &str,
    name: &str,
    value: Value,
) -> Result<Response, ApiError> {
    let rt = shared.state().resource_type(ty).clone();
    let p = object::prepare(&rt, value, (!ns.is_empty()).then_some(ns))?;
    if p.name != name {
        return Err(ApiError::bad_request(format!(
            "the name of the object ({}) does not match the name on the URL ({name})",
            p.name
        )));
    }
    let obj = shared.write(|st| st.replace(ty, p, true))?;
    Ok(json_response(StatusCode::OK, obj.json.to_vec()))
}

/// PATCH: a JSON merge patch (`application/merge-patch+json`, RFC 7386) of an existing
/// object, or a server-side apply (`application/apply-patch+yaml`, sent as JSON by kube),
/// which creates the object when it does not exist. Apply is served as a merge of the
/// applied configuration: no field ownership, no conflicts (more lenient than
/// kube-apiserver, which rejects a conflicting field manager without `force`). Other
/// patch types (JSON patch, strategic merge) are refused with 415, as kube-apiserver
/// refuses them for custom resources.
fn patch(
    shared: &Shared,
    ty: usize,
    ns: &str,
    name: &str,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<Response, ApiError> {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let apply = match content_type.split(';').next().unwrap_or("").trim() {
        "application/apply-patch+yaml" => true,
        "application/merge-patch+json" => false,
        other => {
            return Err(ApiError::new(
                415,
                "UnsupportedMediaType",
                format!(
                    "the body of the request was in an unknown format - accepted media types include: application/merge-patch+json, application/apply-patch+yaml (got {other:?})"
                ),
            ));
        }
    };
    let patch = parse_body(body)?;
    let (existing, rt) = {
        let st = shared.state();
        (st.get(ty, ns, name), st.resource_type(ty).clone())
    };
    let Some(existing) = existing else {
        if !apply {
            return Err(ApiError::not_found(&rt.qualified(), name));
        }
        let p = object::prepare(&rt, patch, (!ns.is_empty()).then_some(ns))?;
        let obj = shared.write(|st| st.create(ty, p))?;
        return Ok(json_response(StatusCode::CREATED, obj.json.to_vec()));
    };
    let mut merged = existing.value();
    merge_patch(&mut merged, patch);
    replace_with(shared, ty, ns, name, merged)
}

/// RFC 7386 JSON merge patch: objects merge key by key, `null` removes, anything else
/// replaces.
fn merge_patch(target: &mut Value, patch: Value) {
    match patch {
        Value::Object(fields) => {
            if !target.is_object() {
                *target = Value::Object(Default::default());
            }
            let obj = target.as_object_mut().expect("made an object above");
            for (k, v) in fields {
                if v.is_null() {
                    obj.remove(&k);
                } else {
                    merge_patch(obj.entry(k).or_insert(Value::Null), v);
                }
            }
        }
        other => *target = other,
    }
}

/// The JSON of an object, or its `PartialObjectMetadata` form.
pub(crate) fn render(obj: &StoredObject, meta_only: bool) -> Bytes {
    if !meta_only {
        return obj.json.clone();
    }
    let mut value = obj.value();
    let metadata = value
        .get_mut("metadata")
        .map(Value::take)
        .unwrap_or(Value::Null);
    let partial = serde_json::json!({
        "apiVersion": "meta.k8s.io/v1",
        "kind": "PartialObjectMetadata",
        "metadata": metadata,
    });
    Bytes::from(serde_json::to_vec(&partial).unwrap_or_default())
}

/// A deliberately undecodable item: `metadata.name` is a number.
pub(crate) fn malformed_item(rt: &ResourceType, meta_only: bool) -> Vec<u8> {
    let (api_version, kind) = if meta_only {
        (
            "meta.k8s.io/v1".to_string(),
            "PartialObjectMetadata".to_string(),
        )
    } else {
        (rt.api_version(), rt.kind.clone())
    };
    let v = serde_json::json!({
        "apiVersion": api_version,
        "kind": kind,
        "metadata": {"name": 12345, "namespace": "default", "resourceVersion": "1"},
    });
    serde_json::to_vec(&v).unwrap_or_default()
}

/// The opaque continue token.
#[derive(Serialize, Deserialize)]
struct ContinueToken {
    rv: u64,
    ns: String,
    name: String,
    served: usize,
    epoch: u64,
    /// Index of the page this token asks for (drives [`crate::ServerOptions::short_pages`]).
    #[serde(default)]
    page: u64,
    /// When the list's first page was served (unix ms), for [`crate::Faults::continue_ttl`].
    #[serde(default)]
    started_ms: u64,
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or_default()
}

fn decode_token(s: &str) -> Result<ContinueToken, ApiError> {
    URL_SAFE_NO_PAD
        .decode(s.trim_end_matches('='))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .ok_or_else(|| {
            ApiError::bad_request("invalid value for continue: not a valid continue token")
        })
}

const EXPIRED_CONTINUE: &str = "The provided continue parameter is too old to display a consistent list result. \
    You can start a new list without the continue parameter.";

/// apimachinery's `ValidateListOptions` for a LIST (not watch) request.
fn validate_list(
    params: &Params,
    rv: &str,
    rv_match: &str,
    ignore_send_initial: bool,
) -> Result<Vec<FieldError>, ApiError> {
    let cont = params.get("continue").map(String::as_str).unwrap_or("");
    let mut errs = Vec::new();
    if !rv_match.is_empty() {
        if rv.is_empty() {
            errs.push(FieldError::forbidden(
                "resourceVersionMatch",
                "resourceVersionMatch is forbidden unless resourceVersion is provided",
            ));
        }
        if !cont.is_empty() {
            errs.push(FieldError::forbidden(
                "resourceVersionMatch",
                "resourceVersionMatch is forbidden when continue is provided",
            ));
        }
        if rv_match != "Exact" && rv_match != "NotOlderThan" {
            errs.push(FieldError::not_supported(
                "resourceVersionMatch",
                rv_match,
                &["Exact", "NotOlderThan", ""],
            ));
        }
        if rv_match == "Exact" && rv == "0" {
            errs.push(FieldError::forbidden(
                "resourceVersionMatch",
                "resourceVersionMatch \"exact\" is forbidden for resourceVersion \"0\"",
            ));
        }
    }
    if !ignore_send_initial && parse_bool(params, "sendInitialEvents")?.is_some() {
        errs.push(FieldError::forbidden(
            "sendInitialEvents",
            "sendInitialEvents is forbidden for list",
        ));
    }
    Ok(errs)
}

/// A LIST page; `stale_at`: answered at that revision whatever it asks for
/// ([`Faults::answer_named_lists_at`](crate::Faults::answer_named_lists_at)), while the
/// history holds it.
async fn list(
    shared: Arc<Shared>,
    ty: usize,
    filter: Filter,
    params: &Params,
    meta_only: bool,
    stale_at: Option<u64>,
) -> Result<Response, ApiError> {
    let opaque = shared.opts.opaque_resource_versions;
    let limit = match params.get("limit").map(|l| l.parse::<u64>()) {
        None | Some(Ok(0)) => None,
        Some(Ok(n)) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
        Some(Err(_)) => return Err(ApiError::bad_request("invalid value for limit")),
    };
    let rv = params
        .get("resourceVersion")
        .map(String::as_str)
        .unwrap_or("");
    let rv_match = params
        .get("resourceVersionMatch")
        .map(String::as_str)
        .unwrap_or("");
    let ignore_send_initial = shared.opts.streaming_lists == StreamingLists::Ignored;
    let errs = validate_list(params, rv, rv_match, ignore_send_initial)?;
    if !errs.is_empty() {
        return Ok(invalid_list_options(&errs));
    }
    let rv = rv::parse_param(rv, opaque)?;
    let token = match params.get("continue").filter(|c| !c.is_empty()) {
        Some(c) => {
            shared.faults().continues_asked.insert(c.clone());
            Some(decode_token(c)?)
        }
        None => None,
    };
    if token.is_some() && matches!(rv, RvParam::Rev(_)) {
        return Err(ApiError::bad_request(
            "specifying resource version is not allowed when using continue",
        ));
    }
    // Like kube-apiserver's watch cache, a read at a revision not reached yet waits for it.
    if let (None, RvParam::Rev(n)) = (&token, rv)
        && let Err(current) = shared.wait_for_revision(n).await
    {
        return Err(ApiError::too_large_resource_version(
            &rv::render(n, opaque),
            &rv::render(current, opaque),
        ));
    }
    let delay = shared.faults().page_delay();
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let (malformed, injected) = {
        let mut f = shared.faults();
        (f.take_malformed_list(), f.take_injected_list())
    };

    let ttl = shared.faults().continue_ttl();
    let (page, snapshot, served, page_no, epoch, rt, started_ms) = {
        let st = shared.state();
        let (snapshot, after, served, page_no, started_ms) = if let Some(t) = token {
            let aged = ttl
                .is_some_and(|ttl| unix_ms().saturating_sub(t.started_ms) > ttl.as_millis() as u64);
            if t.epoch != st.compactions || t.rv < st.floor || aged {
                return Err(ApiError::expired(EXPIRED_CONTINUE));
            }
            (t.rv, Some((t.ns, t.name)), t.served, t.page, t.started_ms)
        } else {
            let stale = stale_at.filter(|r| *r >= st.floor && *r <= st.revision);
            let snapshot = if let Some(stale) = stale {
                stale
            } else {
                match rv {
                    RvParam::Unset | RvParam::Any => st.revision,
                    RvParam::Rev(n) if n > st.revision => {
                        return Err(ApiError::too_large_resource_version(
                            &st.rv(n),
                            &st.rv(st.revision),
                        ));
                    }
                    RvParam::Rev(n) if rv_match == "Exact" => {
                        if n < st.floor {
                            return Err(ApiError::expired(format!(
                                "too old resource version: {} ({})",
                                st.rv(n),
                                st.rv(st.floor)
                            )));
                        }
                        n
                    }
                    RvParam::Rev(_) => st.revision,
                }
            };
            (snapshot, None, 0, 0, unix_ms())
        };
        let page = match (limit, shared.opts.short_pages) {
            // An empty page that still carries a continue token (if anything is left).
            (Some(_), true) if page_no % 3 == 1 => {
                let probe = st.list_page(ty, snapshot, after.as_ref(), Some(1), &filter);
                Page {
                    next_after: if probe.items.is_empty() {
                        None
                    } else {
                        after.clone()
                    },
                    items: Vec::new(),
                    total: probe.total,
                }
            }
            (Some(l), true) => {
                let short = l.div_ceil(2).max(1);
                st.list_page(ty, snapshot, after.as_ref(), Some(short), &filter)
            }
            (l, _) => st.list_page(ty, snapshot, after.as_ref(), l, &filter),
        };
        (
            page,
            snapshot,
            served,
            page_no,
            st.compactions,
            st.resource_type(ty).clone(),
            started_ms,
        )
    };

    let served_now = served + page.items.len();
    let mut next_token = None;
    let mut meta = serde_json::Map::new();
    meta.insert(
        "resourceVersion".into(),
        Value::String(rv::render(snapshot, opaque)),
    );
    if let Some((ns, name)) = page.next_after {
        let token = ContinueToken {
            rv: snapshot,
            ns,
            name,
            served: served_now,
            epoch,
            page: page_no + 1,
            started_ms,
        };
        let token = URL_SAFE_NO_PAD.encode(serde_json::to_vec(&token).unwrap_or_default());
        next_token = Some(token.clone());
        meta.insert("continue".into(), Value::String(token));
        if filter.is_trivial() {
            meta.insert(
                "remainingItemCount".into(),
                Value::from(page.total.saturating_sub(served_now)),
            );
        }
    }
    if let Some(shard) = &filter.shard {
        meta.insert(
            "shardInfo".into(),
            serde_json::json!({ "selector": shard.text }),
        );
    }
    let (api_version, kind) = if meta_only {
        (
            "meta.k8s.io/v1".to_string(),
            "PartialObjectMetadataList".to_string(),
        )
    } else {
        (rt.api_version(), format!("{}List", rt.kind))
    };
    let head = serde_json::json!({"apiVersion": api_version, "kind": kind, "metadata": meta});
    let mut out = serde_json::to_vec(&head).unwrap_or_default();
    out.pop(); // the closing brace
    out.extend_from_slice(b",\"items\":[");
    let head_len = out.len();
    let mut first = true;
    for obj in &page.items {
        if !first {
            out.push(b',');
        }
        first = false;
        out.extend_from_slice(&render(obj, meta_only));
    }
    if malformed {
        if !first {
            out.push(b',');
        }
        out.extend_from_slice(&malformed_item(&rt, meta_only));
        first = false;
    }
    for raw in &injected {
        if !first {
            out.push(b',');
        }
        first = false;
        out.extend_from_slice(raw);
    }
    out.extend_from_slice(b"]}");
    match next_token.filter(|_| shared.faults().holds(limit)) {
        Some(token) => Ok(held_until_asked(shared, out, head_len, token)),
        None => Ok(json_response(StatusCode::OK, out)),
    }
}

/// Marks a held page's response: it is streamed, never buffered to be compressed.
#[derive(Clone, Copy)]
struct HeldPage;

/// A page whose items are sent once a LIST has asked for `token` (`Faults::hold_list_bodies`).
fn held_until_asked(shared: Arc<Shared>, out: Vec<u8>, head_len: usize, token: String) -> Response {
    let mut out = Bytes::from(out);
    let head = out.split_to(head_len);
    let items = async move {
        loop {
            {
                let f = shared.faults();
                if f.continues_asked.contains(&token) || !f.hold_list_bodies {
                    break;
                }
            }
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
        Ok::<_, std::io::Error>(out)
    };
    let body = futures::StreamExt::chain(
        futures::stream::once(async move { Ok::<_, std::io::Error>(head) }),
        futures::stream::once(items),
    );
    let mut res = Response::new(Body::from_stream(body));
    res.extensions_mut().insert(HeldPage);
    res.headers_mut().insert(
        axum::http::header::CONTENT_TYPE,
        axum::http::HeaderValue::from_static("application/json"),
    );
    res
}
