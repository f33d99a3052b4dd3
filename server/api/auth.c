#include "auth.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include <openssl/crypto.h>

#include "delta.h"
#include "sign.h"

void auth_free(auth_table *t)
{
    for (size_t i = 0; i < t->n; i++) {
        free(t->e[i].node);
        if (t->e[i].token)
            OPENSSL_cleanse(t->e[i].token, t->e[i].token_len);
        free(t->e[i].token);
    }
    free(t->e);
    t->e = NULL;
    t->n = 0;
}

static int token_char_ok(char c)
{
    return c > ' ' && c < 0x7f;
}

int auth_load(auth_table *out, const char *path, dl_error *err)
{
    FILE *f = fopen(path, "r");
    auth_table t = {0};
    char line[1024];
    int lineno = 0, rc = 0;

    if (f == NULL)
        return dl_fail_errno(err, errno, "cannot open token file %s", path);
    /* a token anyone on the machine can read is a token anyone can upload with: refused, as ssh refuses
     * a private key others can read (checked on the descriptor read, so a swap in between cannot pass) */
    if ((rc = sign_check_private_fd(fileno(f), "token file", path, err)) != 0) {
        fclose(f);
        return rc;
    }
    while (rc == 0 && fgets(line, sizeof(line), f) != NULL) {
        char *node, *token, *save = NULL, *extra;
        lineno++;
        if (strchr(line, '\n') == NULL && !feof(f)) {
            rc = dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "%s:%d: line too long", path, lineno);
            break;
        }
        node = strtok_r(line, " \t\r\n", &save);
        if (node == NULL || node[0] == '#')
            continue;
        token = strtok_r(NULL, " \t\r\n", &save);
        extra = strtok_r(NULL, " \t\r\n", &save);
        if (token == NULL || extra != NULL) {
            rc = dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "%s:%d: expected 'node_id token'", path, lineno);
            break;
        }
        if (strcmp(node, "*") != 0 && !delta_valid_node_id(node, strlen(node))) {
            rc = dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "%s:%d: invalid node id", path, lineno);
            break;
        }
        size_t tl = strlen(token);
        int ok = tl >= AUTH_MIN_TOKEN && tl <= AUTH_MAX_TOKEN;
        for (size_t i = 0; ok && i < tl; i++)
            ok = token_char_ok(token[i]);
        if (!ok) {
            rc = dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0,
                         "%s:%d: token must be %d to %d printable characters", path, lineno, AUTH_MIN_TOKEN,
                         AUTH_MAX_TOKEN);
            break;
        }
        auth_entry *ne = realloc(t.e, (t.n + 1) * sizeof(*ne));
        if (ne == NULL) {
            rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
            break;
        }
        t.e = ne;
        t.e[t.n].token = NULL;
        t.e[t.n].token_len = tl;
        int oom = (t.e[t.n].node = strdup(node)) == NULL || (t.e[t.n].token = strdup(token)) == NULL;
        t.n++;                          /* freed with the table, whole or not */
        OPENSSL_cleanse(token, tl);
        if (oom)
            rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    }
    fclose(f);
    if (rc == 0 && t.n == 0)
        rc = dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "%s holds no token", path);
    if (rc != 0) {
        auth_free(&t);
        return rc;
    }
    auth_free(out);
    *out = t;
    return 0;
}

auth_result auth_check(const auth_table *t, const char *authorization, const char *node_id)
{
    const char *tok;
    size_t tl;
    int match_node = 0, match_admin = 0, match_other = 0;

    if (authorization == NULL || strncasecmp(authorization, "Bearer ", 7) != 0)
        return AUTH_MISSING;
    tok = authorization + 7;
    while (*tok == ' ')
        tok++;
    tl = strlen(tok);
    while (tl > 0 && tok[tl - 1] == ' ')
        tl--;
    /* every entry is compared, matched or not, so the time taken does not depend on which matched */
    for (size_t i = 0; i < t->n; i++) {
        const auth_entry *e = &t->e[i];
        int same = e->token_len == tl && CRYPTO_memcmp(e->token, tok, tl) == 0;
        int admin = strcmp(e->node, "*") == 0;
        int mine = strcmp(e->node, node_id) == 0;
        match_admin |= same & admin;
        match_node |= same & mine;
        match_other |= same & !admin & !mine;
    }
    if (match_node || match_admin)
        return AUTH_OK;
    return match_other ? AUTH_WRONG_NODE : AUTH_BAD_TOKEN;
}
