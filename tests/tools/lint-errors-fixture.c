/* The fixture of tests/tools/lint-errors.sh --self-test (never compiled): every line whose comment
 * opens with the word BAD must be found, and nothing else; a case the lint must accept has no mark. */
/* sprintf(x) in a comment is fine, "strcpy(" in a string too */
static const char *s = "atoi(";
void f(char *d, const char *src)
{
    char buf[8];
    sprintf(buf, "%d", 1);                    /* BAD banned */
    strcpy(d, src);                           /* BAD banned */
    int n = atoi(src);                        /* BAD banned */
    char *p = malloc(10);                     /* BAD alloc: used before a test */
    p[0] = 1;
    if (p == NULL)
        return;
    char *q = strdup(src);                    /* BAD alloc: never tested */
    use(q);
    foo(strdup(src));                         /* BAD alloc: an argument */
    asprintf(&p, "%s", src);                  /* BAD asprintf */
    (void)asprintf(&p, "%s", src);            /* BAD asprintf */
    exit(1);                                  /* BAD exit */
    abort();                                  /* BAD exit */
    raise(SIGTERM);                           /* BAD exit */
    char *ok1 = malloc(4);
    int z = 0;
    if (ok1 == NULL)
        return;
    if ((p = strdup(src)) == NULL)
        return;
    if (asprintf(&p, "%s", src) < 0)
        return;
    int m = asprintf(&p, "%s", src);
    if (m < 0)
        return;
    x->y = q ? strndup(src, 2) : strdup(src);
    if (x->y == NULL)
        return;
    if (a == NULL)
        return strdup("x");
    bad = (r[i] = strdup(src)) == NULL;
    c->body->abort(c, 1);
    snprintf(buf, 8, "x"); strtok_r(d, " ", &p);
    /* lint-errors: allow alloc: the callee takes NULL */
    push(strdup(src));
    char *w = malloc(3);                      /* BAD alloc: a decision before its test */
    if (z)
        return;
    if (w == NULL)
        return;
    char *v = malloc(3);
    p = v ? v : NULL;
}
void g(void)
{
    seen_map n = {calloc(4, 1), 4, 0};
    if (n.slots == NULL)
        return;
    seen_map m = {calloc(4, 1), 4, 0};        /* BAD alloc: never tested */
    c->h[0] = (http_header){strdup(a), NULL}; /* BAD alloc: in a literal */
    if (x) {
        y = 1;
    }
    char *u = strdup(a);                      /* BAD alloc: a block before its test */
    {
        y = 2;
    }
    if (u == NULL)
        return;
}
void h(void)
{
    if (a) {
        c->tok = strdup(line);
        memset(line, 0, 4);
    } else if (b) {
        c->tok = strdup(env);
    } else
        c->tok = NULL;
    if (c->tok == NULL)
        return;
    if (a) {
        c->r = strdup(line);                  /* BAD alloc: used after its block */
    }
    use(c->r);
}
void k(const char *dir)
{
    char *p;
    if (asprintf(&p, "%s/cache/incoming/x", dir) < 0)   /* BAD state-path */
        return;
    log_it("outer_metadata.json is damaged");            /* a message, not a path */
}
