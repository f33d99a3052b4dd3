/* auth: per-node bearer tokens from a token file, lines "node_id token" ("*" as the node id marks an
 * admin token that may upload for any node); "#" comments and blank lines are ignored.  Tokens are
 * compared in constant time (CRYPTO_memcmp) against every entry, so timing tells nothing of them. */
#ifndef AUTH_H
#define AUTH_H

#include <stddef.h>

#include "dl_error.h"

#define AUTH_MIN_TOKEN 16
#define AUTH_MAX_TOKEN 256

typedef struct auth_entry {
    char *node;                 /* node id or "*" */
    char *token;
    size_t token_len;
} auth_entry;

typedef struct auth_table {
    auth_entry *e;
    size_t n;
} auth_table;

/* Loads path into t, replacing its entries only on success (a bad file leaves the old table in
 * force).  Refuses malformed lines, invalid node ids and tokens shorter than AUTH_MIN_TOKEN. */
int auth_load(auth_table *t, const char *path, dl_error *err);
void auth_free(auth_table *t);

typedef enum auth_result { AUTH_OK, AUTH_MISSING, AUTH_BAD_TOKEN, AUTH_WRONG_NODE } auth_result;

/* Checks an Authorization header value ("Bearer <token>", may be NULL) for an upload by node_id. */
auth_result auth_check(const auth_table *t, const char *authorization, const char *node_id);

#endif
