/*
 * A small C layer over UCX's UCP API for the rdma backend (cargo feature `rdma`), so that the
 * Rust side never lays out UCX's parameter structs itself (their layout and field masks are
 * what the header says, not what a hand-written binding guesses).
 *
 * One `duet_ucx_t` = one UCP context + one worker (UCS_THREAD_MODE_SERIALIZED: the Rust owner
 * calls it from one task at a time) + at most one endpoint. Tag messages only. Completion is
 * reported into a caller-owned `duet_ucx_op_t`, which must stay in place until `done` is set.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucp/api/ucp.h>

typedef struct {
    volatile int done;
    int status;
    uint64_t length;
} duet_ucx_op_t;

typedef struct {
    ucp_context_h context;
    ucp_worker_h worker;
    ucp_ep_h ep;
    int peer_mode; /* the endpoint has UCP_ERR_HANDLING_MODE_PEER */
    volatile int ep_failed;
} duet_ucx_t;

#define TAG_MASK_FULL ((ucp_tag_t)-1)

static void set_err(char *err, size_t len, const char *what, ucs_status_t s) {
    if (err != NULL && len > 0) {
        snprintf(err, len, "%s: %s", what, ucs_status_string(s));
    }
}

const char *duet_ucx_status_string(int status) {
    return ucs_status_string((ucs_status_t)status);
}

int duet_ucx_open(const char *tls, duet_ucx_t **out, char *err, size_t err_len) {
    ucp_config_t *config = NULL;
    ucs_status_t s = ucp_config_read(NULL, NULL, &config);
    if (s != UCS_OK) {
        set_err(err, err_len, "reading the UCX configuration", s);
        return (int)s;
    }
    if (tls != NULL && tls[0] != '\0') {
        s = ucp_config_modify(config, "TLS", tls);
        if (s != UCS_OK) {
            ucp_config_release(config);
            set_err(err, err_len, "setting UCX_TLS", s);
            return (int)s;
        }
    }
    ucp_params_t params;
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
    params.mt_workers_shared = 0;
    duet_ucx_t *h = calloc(1, sizeof(*h));
    if (h == NULL) {
        ucp_config_release(config);
        set_err(err, err_len, "allocating", UCS_ERR_NO_MEMORY);
        return (int)UCS_ERR_NO_MEMORY;
    }
    s = ucp_init(&params, config, &h->context);
    ucp_config_release(config);
    if (s != UCS_OK) {
        free(h);
        set_err(err, err_len, "initialising UCP", s);
        return (int)s;
    }
    ucp_worker_params_t wp;
    memset(&wp, 0, sizeof(wp));
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
    s = ucp_worker_create(h->context, &wp, &h->worker);
    if (s != UCS_OK) {
        ucp_cleanup(h->context);
        free(h);
        set_err(err, err_len, "creating the UCP worker", s);
        return (int)s;
    }
    *out = h;
    return 0;
}

static void wait_request(duet_ucx_t *h, void *req) {
    if (req == NULL || UCS_PTR_IS_ERR(req)) {
        return;
    }
    /* Bounded: a forced close completes at once; a flushing close finishes, fails with the
     * peer, or is given up here (the request is then released when it completes). */
    for (int i = 0; i < 100000 && ucp_request_check_status(req) == UCS_INPROGRESS; i++) {
        ucp_worker_progress(h->worker);
    }
    ucp_request_free(req);
}

/* Closes the endpoint. With peer error handling it is forced, and every outstanding send
 * completes with UCS_ERR_CANCELED; without it UCX forbids forcing, so the close flushes
 * (outstanding sends may then stay pending: the caller destroys the worker if they do). */
void duet_ucx_ep_close(duet_ucx_t *h) {
    if (h->ep != NULL) {
        ucp_request_param_t p;
        memset(&p, 0, sizeof(p));
        if (h->peer_mode) {
            p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
            p.flags = UCP_EP_CLOSE_FLAG_FORCE;
        }
        wait_request(h, ucp_ep_close_nbx(h->ep, &p));
        h->ep = NULL;
    }
}

void duet_ucx_close(duet_ucx_t *h) {
    if (h == NULL) {
        return;
    }
    duet_ucx_ep_close(h);
    ucp_worker_destroy(h->worker);
    ucp_cleanup(h->context);
    free(h);
}

int duet_ucx_address(duet_ucx_t *h, void **addr, size_t *len) {
    ucp_address_t *a = NULL;
    ucs_status_t s = ucp_worker_get_address(h->worker, &a, len);
    *addr = a;
    return (int)s;
}

void duet_ucx_address_free(duet_ucx_t *h, void *addr) {
    ucp_worker_release_address(h->worker, (ucp_address_t *)addr);
}

static void on_ep_error(void *arg, ucp_ep_h ep, ucs_status_t status) {
    (void)ep;
    (void)status;
    ((duet_ucx_t *)arg)->ep_failed = 1;
}

/* Peer failure handling where the transports support it (verbs, tcp); UCX's shared-memory
 * transports do not, so those endpoints are created without it (a vanished peer is then
 * noticed on the control connection, see the Rust side). */
int duet_ucx_connect(duet_ucx_t *h, const void *addr) {
    ucp_ep_params_t ep;
    memset(&ep, 0, sizeof(ep));
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = (const ucp_address_t *)addr;
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = on_ep_error;
    ep.err_handler.arg = h;
    ucs_status_t s = ucp_ep_create(h->worker, &ep, &h->ep);
    if (s == UCS_OK) {
        h->peer_mode = 1;
        return 0;
    }
    /* Only for want of peer error handling in the selected transports. */
    if (s != UCS_ERR_UNREACHABLE && s != UCS_ERR_UNSUPPORTED) {
        return (int)s;
    }
    ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
    h->peer_mode = 0;
    return (int)ucp_ep_create(h->worker, &ep, &h->ep);
}

int duet_ucx_ep_failed(const duet_ucx_t *h) {
    return h->ep_failed;
}

int duet_ucx_efd(duet_ucx_t *h, int *fd) {
    return (int)ucp_worker_get_efd(h->worker, fd);
}

unsigned duet_ucx_progress(duet_ucx_t *h) {
    return ucp_worker_progress(h->worker);
}

/* 0: armed (the efd will signal the next event); 1: events pending, progress again; <0: error. */
int duet_ucx_arm(duet_ucx_t *h) {
    ucs_status_t s = ucp_worker_arm(h->worker);
    if (s == UCS_OK) {
        return 0;
    }
    return s == UCS_ERR_BUSY ? 1 : (int)s;
}

static void on_send(void *request, ucs_status_t status, void *user_data) {
    (void)request;
    duet_ucx_op_t *op = user_data;
    op->status = (int)status;
    op->done = 1;
}

static void on_recv(void *request, ucs_status_t status, const ucp_tag_recv_info_t *info,
                    void *user_data) {
    (void)request;
    duet_ucx_op_t *op = user_data;
    op->status = (int)status;
    op->length = (status == UCS_OK && info != NULL) ? (uint64_t)info->length : 0;
    op->done = 1;
}

/* Resets a completion record before its operation is posted. */
static void op_start(duet_ucx_op_t *op, uint64_t length) {
    op->done = 0;
    op->status = 0;
    op->length = length;
}

/* Send-side parameters: completion through `on_send` into `op`. */
static ucp_request_param_t send_param(duet_ucx_op_t *op) {
    ucp_request_param_t p;
    memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send = on_send;
    p.user_data = op;
    return p;
}

/* Turns a UCX status pointer into the shim's convention: 0 with *req NULL and op->done set
 * when the operation completed at once, 0 with *req set when it is in flight (op->done is
 * set by the callback), <0 on error. */
static int posted(ucs_status_ptr_t r, duet_ucx_op_t *op, void **req) {
    *req = NULL;
    if (UCS_PTR_IS_ERR(r)) {
        return (int)UCS_PTR_STATUS(r);
    }
    if (r == NULL) {
        op->done = 1;
        return 0;
    }
    *req = r;
    return 0;
}

/* Posts one tag send (see `posted` for the result). */
int duet_ucx_send(duet_ucx_t *h, uint64_t tag, const void *buf, size_t len, duet_ucx_op_t *op,
                  void **req) {
    *req = NULL;
    op_start(op, len);
    if (h->ep == NULL || h->ep_failed) {
        return (int)UCS_ERR_NOT_CONNECTED;
    }
    ucp_request_param_t p = send_param(op);
    return posted(ucp_tag_send_nbx(h->ep, buf, len, (ucp_tag_t)tag, &p), op, req);
}

/* Flushes the endpoint: completes (into op) once everything sent so far reached the peer. */
int duet_ucx_flush(duet_ucx_t *h, duet_ucx_op_t *op, void **req) {
    *req = NULL;
    op_start(op, 0);
    if (h->ep == NULL || h->ep_failed) {
        return (int)UCS_ERR_NOT_CONNECTED;
    }
    ucp_request_param_t p = send_param(op);
    return posted(ucp_ep_flush_nbx(h->ep, &p), op, req);
}

/* Posts one tag receive (see `posted`). Always completed through the callback, which gets
 * the message length: UCX 1.13 does not fill `recv_info` when a receive completes at once
 * from the unexpected queue, and the length must be checked. */
int duet_ucx_recv(duet_ucx_t *h, uint64_t tag, void *buf, size_t len, duet_ucx_op_t *op,
                  void **req) {
    op_start(op, 0);
    ucp_request_param_t p;
    memset(&p, 0, sizeof(p));
    p.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    p.cb.recv = on_recv;
    p.user_data = op;
    return posted(ucp_tag_recv_nbx(h->worker, buf, len, (ucp_tag_t)tag, TAG_MASK_FULL, &p), op,
                  req);
}

void duet_ucx_cancel(duet_ucx_t *h, void *req) {
    ucp_request_cancel(h->worker, req);
}

void duet_ucx_free(void *req) {
    ucp_request_free(req);
}
