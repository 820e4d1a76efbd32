// jetworker dashboard. Plain JavaScript, no build step.
//
// Rules this file keeps:
// - Data from the broker (ids, output, errors, host names, labels) only
//   ever reaches the page as text (textContent / text nodes), never as
//   markup: a task printing <script> shows the characters.
// - Live updates come from one EventSource (/api/events). Each event
//   names the rows that changed, keyed by id; only those rows' cells are
//   touched (and only when their text differs). Nothing is re-rendered
//   wholesale on a timer.
// - Actions are POSTs with JSON and the CSRF token from the page's <meta>.
'use strict';

(function () {
  const CSRF = meta('jetworker-csrf');
  const ACTIONS = meta('jetworker-actions') === 'on';

  function meta(name) {
    const m = document.querySelector('meta[name="' + name + '"]');
    return m ? m.getAttribute('content') : '';
  }

  const $ = (id) => document.getElementById(id);

  // An element with text children only. props: class, text, href, title, type.
  function h(tag, props, ...children) {
    const e = document.createElement(tag);
    if (props) {
      for (const [k, v] of Object.entries(props)) {
        if (v === undefined || v === null) continue;
        if (k === 'class') e.className = v;
        else if (k === 'text') e.textContent = v;
        else if (k === 'onclick') e.addEventListener('click', v);
        else e.setAttribute(k, v);
      }
    }
    for (const c of children) {
      if (c === null || c === undefined) continue;
      e.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return e;
  }

  // Set text only when it changed (no needless layout work).
  function setText(node, text) {
    text = text === null || text === undefined ? '' : String(text);
    if (node.textContent !== text) node.textContent = text;
  }

  function pad(n) { return n < 10 ? '0' + n : '' + n; }

  function fmtTime(iso) {
    if (!iso) return '';
    const d = new Date(iso);
    if (isNaN(d)) return '';
    const now = new Date();
    const hms = pad(d.getHours()) + ':' + pad(d.getMinutes()) + ':' + pad(d.getSeconds());
    if (d.toDateString() === now.toDateString()) return hms;
    return d.getFullYear() + '-' + pad(d.getMonth() + 1) + '-' + pad(d.getDate()) + ' ' + hms;
  }

  function fmtDuration(ms) {
    if (ms === null || ms === undefined) return '';
    if (ms < 1000) return ms + 'ms';
    const s = ms / 1000;
    if (s < 60) return (s < 10 ? s.toFixed(1) : Math.round(s)) + 's';
    const m = Math.floor(s / 60);
    if (m < 60) return m + 'm' + pad(Math.round(s % 60)) + 's';
    const hh = Math.floor(m / 60);
    if (hh < 48) return hh + 'h' + pad(m % 60) + 'm';
    return Math.floor(hh / 24) + 'd' + (hh % 24) + 'h';
  }

  // The smallest 1, 2, 2.5 or 5 × 10^k at or above x (an axis maximum
  // whose quarters read well).
  function niceCeil(x) {
    const p = Math.pow(10, Math.floor(Math.log10(x)));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= x - 1e-9) return m * p;
    return 10 * p;
  }

  function taskLink(id) {
    return h('a', { href: '#/task/' + encodeURIComponent(id), class: 'id', text: id });
  }

  function badge(status, isFinal) {
    const b = h('span', { class: 'badge s-' + status, text: status });
    if (isFinal === false && status !== 'running' && status !== 'queued') {
      b.textContent = status + ' (retrying)';
    }
    return b;
  }

  function setBadge(node, status, isFinal) {
    const want = 'badge s-' + status;
    if (node.className !== want) node.className = want;
    let text = status;
    if (isFinal === false && status !== 'running' && status !== 'queued') text += ' (retrying)';
    setText(node, text);
  }

  let toastTimer = null;
  function toast(message, bad) {
    const t = $('toast');
    t.textContent = message;
    t.className = 'toast' + (bad ? ' bad' : '');
    t.hidden = false;
    clearTimeout(toastTimer);
    toastTimer = setTimeout(() => { t.hidden = true; }, 6000);
  }

  async function getJSON(url) {
    const r = await fetch(url, { credentials: 'same-origin' });
    const body = await r.json().catch(() => ({ message: r.status + ' ' + r.statusText }));
    if (!r.ok) throw new Error(body.message || (r.status + ' ' + r.statusText));
    return body;
  }

  async function act(action, body) {
    const r = await fetch('/api/actions/' + action, {
      method: 'POST',
      credentials: 'same-origin',
      headers: { 'Content-Type': 'application/json', 'X-Jetworker-Csrf': CSRF },
      body: JSON.stringify(body),
    });
    const text = await r.text();
    let answer;
    try { answer = JSON.parse(text); } catch (_) { answer = { ok: false, message: text.trim() }; }
    if (!r.ok) throw new Error(answer.message || (r.status + ' ' + r.statusText));
    return answer;
  }

  async function doAction(action, body, button) {
    if (button) button.disabled = true;
    try {
      const a = await act(action, body);
      toast(a.message || 'done');
      return a;
    } catch (e) {
      toast(e.message, true);
      return null;
    } finally {
      if (button) button.disabled = false;
    }
  }

  // ---------------------------------------------------------------- views

  const views = ['workers', 'queues', 'results', 'task', 'dead', 'schedules', 'submit'];
  let current = null;

  function route() {
    const hash = location.hash.replace(/^#\/?/, '');
    const [name, ...rest] = hash.split('/');
    let view = views.includes(name) ? name : 'workers';
    if (view === 'submit' && !ACTIONS) view = 'workers';
    const arg = rest.length ? decodeURIComponent(rest.join('/')) : null;
    for (const v of views) $('view-' + v).hidden = v !== view;
    for (const a of document.querySelectorAll('nav a')) {
      a.classList.toggle('active', a.dataset.view === view || (view === 'task' && a.dataset.view === 'results'));
    }
    const prev = current;
    current = view;
    if (prev === 'task' && view !== 'task') Task.close();
    if (view === 'queues') Chart.draw();
    if (view === 'results') Results.enter();
    if (view === 'task') Task.open(arg);
    if (view === 'dead') Dead.load();
    if (view === 'schedules') Schedules.load();
    if (view === 'submit') Submit.enter();
  }

  // ------------------------------------------------------------ keyed rows

  // A live list whose rows stay in key order and are updated in place,
  // never rebuilt: `spec` gives makeRow(key) -> {el, c}, fill(row, item)
  // and summary(); events bring {rows, removed}, a snapshot the whole list.
  function keyedRows(tableId, keyOf, spec) {
    return Object.assign({
      rows: new Map(), // key -> {el, c, data, ...}
      sorted: [],      // keys, sorted
      body: null,

      initRows() { this.body = $(tableId).querySelector('.body'); },

      // Insert keeping the key order (binary search).
      place(key, el) {
        let lo = 0, hi = this.sorted.length;
        while (lo < hi) {
          const mid = (lo + hi) >> 1;
          if (this.sorted[mid] < key) lo = mid + 1; else hi = mid;
        }
        const before = lo < this.sorted.length ? this.rows.get(this.sorted[lo]).el : null;
        this.sorted.splice(lo, 0, key);
        this.body.insertBefore(el, before);
      },

      upsert(item) {
        const key = keyOf(item);
        let r = this.rows.get(key);
        if (!r) {
          r = this.makeRow(key);
          this.rows.set(key, r);
          this.place(key, r.el);
        }
        r.data = item;
        this.fill(r, item);
      },

      remove(key) {
        const r = this.rows.get(key);
        if (!r) return;
        r.el.remove();
        this.rows.delete(key);
        const i = this.sorted.indexOf(key);
        if (i >= 0) this.sorted.splice(i, 1);
      },

      snapshot(list) {
        const keep = new Set(list.map(keyOf));
        for (const key of [...this.rows.keys()]) if (!keep.has(key)) this.remove(key);
        for (const item of list) this.upsert(item);
        this.summary();
      },

      apply(ev) {
        for (const key of ev.removed || []) this.remove(key);
        for (const item of ev.rows || []) this.upsert(item);
        this.summary();
      },
    }, spec);
  }

  // -------------------------------------------------------------- workers

  const Workers = keyedRows('workers-table', (w) => w.id, {
    filter: '',

    init() {
      this.initRows();
      $('workers-filter').addEventListener('input', (e) => {
        this.filter = e.target.value.trim().toLowerCase();
        for (const r of this.rows.values()) this.applyFilter(r);
      });
    },

    makeRow(id) {
      const c = {
        state: h('span', { class: 'state' }),
        id: h('span', { class: 'id', text: id }),
        host: h('span'),
        labels: h('span'),
        types: h('span'),
        running: h('span', { class: 'num' }),
        tasks: h('span', { class: 'tasks' }),
        version: h('span'),
        started: h('span'),
        seen: h('span'),
      };
      const el = h('div', { class: 'row' }, c.state, c.id, c.host, c.labels, c.types, c.running, c.tasks, c.version, c.started, c.seen);
      el.dataset.id = id;
      return { el, c, data: null, tasksKey: null };
    },

    fill(r, w) {
      const c = r.c;
      r.el.classList.toggle('offline', !w.online);
      setText(c.state, w.online ? '●' : '○');
      c.state.title = w.online ? 'online' : 'offline (' + (w.offline_reason || 'gone') + ')';
      setText(c.host, w.hostname + ' · pid ' + w.pid);
      setText(c.labels, (w.labels || []).join(', '));
      setText(c.types, (w.types || []).join(', '));
      c.labels.title = c.labels.textContent;
      c.types.title = c.types.textContent;
      setText(c.running, w.online ? w.running + ' / ' + w.slots : '– / ' + w.slots);
      const key = w.online ? (w.tasks || []).join(' ') : '';
      if (key !== r.tasksKey) {
        r.tasksKey = key;
        c.tasks.replaceChildren();
        const tasks = w.online ? (w.tasks || []) : [];
        tasks.slice(0, 4).forEach((t, i) => {
          if (i) c.tasks.append(' ');
          c.tasks.append(taskLink(t));
        });
        if (tasks.length > 4) c.tasks.append(' +' + (tasks.length - 4));
      }
      setText(c.version, w.version);
      setText(c.started, fmtTime(w.started_at));
      setText(c.seen, w.online ? fmtTime(w.seen_at) : 'offline ' + fmtTime(w.offline_at) + ' (' + (w.offline_reason || 'gone') + ')');
      this.applyFilter(r);
    },

    applyFilter(r) {
      const f = this.filter;
      let show = true;
      if (f) {
        const w = r.data;
        const hay = [w.id, w.hostname, w.version, ...(w.labels || []), ...(w.types || [])].join(' ').toLowerCase();
        show = hay.includes(f);
      }
      if (r.el.hidden === show) r.el.hidden = !show;
    },

    summary() {
      let online = 0, offline = 0, slots = 0, running = 0;
      for (const r of this.rows.values()) {
        if (r.data.online) { online++; slots += r.data.slots; running += r.data.running; } else offline++;
      }
      setText($('n-workers'), online);
      setText($('workers-summary'), online + ' online, ' + offline + ' offline · ' + running + ' of ' + slots + ' slots busy');
      $('workers-empty').hidden = this.rows.size > 0;
    },
  });

  // --------------------------------------------------------------- queues

  const Queues = keyedRows('queues-table', (q) => q.label, {
    init() { this.initRows(); },

    makeRow(label) {
      const c = {
        label: h('span', { class: 'id', text: label }),
        waiting: h('span', { class: 'num' }),
        running: h('span', { class: 'num', title: 'running on online workers; delayed: handed out, not running (retry backoff, a hand-back, an id running elsewhere)' }),
        redelivered: h('span', { class: 'num' }),
        oldest: h('span', { class: 'num' }),
        workers: h('span', { class: 'num' }),
        slots: h('span', { class: 'num' }),
        state: h('span'),
        action: h('span', { class: 'action-only' }),
      };
      const button = h('button', { type: 'button' });
      button.addEventListener('click', () => {
        const r = this.rows.get(label);
        const paused = r && r.data && r.data.paused;
        doAction(paused ? 'resume' : 'pause', { label }, button);
      });
      c.action.append(button);
      const el = h('div', { class: 'row' }, c.label, c.waiting, c.running, c.redelivered, c.oldest, c.workers, c.slots, c.state, c.action);
      return { el, c, button, data: null };
    },

    fill(r, q) {
      const c = r.c;
      setText(c.waiting, q.waiting);
      setText(c.running, q.delayed ? q.running + ' (+' + q.delayed + ' delayed)' : q.running);
      setText(c.redelivered, q.redelivered);
      setText(c.oldest, q.oldest_waiting_ms === null || q.oldest_waiting_ms === undefined ? '–' : fmtDuration(q.oldest_waiting_ms));
      setText(c.workers, (q.workers || []).length);
      c.workers.title = (q.workers || []).join('\n');
      setText(c.slots, q.slots);
      const state = q.paused ? 'paused' + (q.paused_until ? ' until ' + fmtTime(q.paused_until) : '') : (q.consumer === false ? 'no consumer yet' : 'active');
      setText(c.state, state);
      r.el.classList.toggle('paused', !!q.paused);
      setText(r.button, q.paused ? 'Resume' : 'Pause');
      r.button.disabled = q.consumer === false;
    },

    summary() {
      let waiting = 0;
      for (const r of this.rows.values()) waiting += r.data.waiting || 0;
      setText($('n-queues'), waiting ? waiting + ' waiting' : '');
      $('queues-empty').hidden = this.rows.size > 0;
    },
  });

  // ---------------------------------------------------------------- chart

  const Chart = {
    points: new Map(), // t -> point
    bucket: 5,
    window: 600,
    now: 0,

    snapshot(points, bucket, window) {
      this.bucket = bucket;
      this.window = window;
      this.points.clear();
      for (const p of points) this.points.set(p.t, p);
      this.now = Date.now() / 1000;
      this.draw();
    },

    apply(ev) {
      for (const p of ev.points || []) this.points.set(p.t, p);
      this.now = ev.now || Date.now() / 1000;
      const oldest = this.now - this.window - this.bucket;
      for (const t of [...this.points.keys()]) if (t < oldest) this.points.delete(t);
      if (current === 'queues') this.draw();
    },

    draw() {
      const canvas = $('chart');
      const box = canvas.clientWidth;
      if (box && Math.abs(canvas.width - box) > 4) canvas.width = box;
      const W = canvas.width, H = canvas.height;
      const g = canvas.getContext('2d');
      g.clearRect(0, 0, W, H);
      const left = 48, right = 56, top = 10, bottom = 22;
      const pw = W - left - right, ph = H - top - bottom;
      const end = Math.floor((this.now || Date.now() / 1000) / this.bucket) * this.bucket;
      const start = end - this.window + this.bucket;
      const n = Math.round(this.window / this.bucket);
      let maxRate = 0, maxLat = 0;
      const pts = [];
      for (let i = 0; i < n; i++) {
        const t = start + i * this.bucket;
        const p = this.points.get(t);
        pts.push(p || null);
        if (p) {
          maxRate = Math.max(maxRate, p.done / this.bucket);
          if (p.p95_ms !== null) maxLat = Math.max(maxLat, p.p95_ms);
        }
      }
      maxRate = niceCeil(Math.max(maxRate, 0.2));
      maxLat = niceCeil(Math.max(maxLat, 20));
      const bw = pw / n;
      const ok = getComputedStyle(document.body).getPropertyValue('--ok') || '#2e9e5b';
      g.font = '11px system-ui, sans-serif';
      g.strokeStyle = '#d8dde3';
      g.fillStyle = '#6b7682';
      g.lineWidth = 1;
      for (let i = 0; i <= 4; i++) {
        const y = top + ph - (ph * i) / 4;
        g.beginPath(); g.moveTo(left, y + 0.5); g.lineTo(left + pw, y + 0.5); g.stroke();
        g.textAlign = 'right';
        g.fillText(String(+((maxRate * i) / 4).toFixed(2)), left - 6, y + 4);
        g.textAlign = 'left';
        g.fillText(fmtDuration(Math.round((maxLat * i) / 4)), left + pw + 6, y + 4);
      }
      g.textAlign = 'center';
      for (let m = 0; m <= 10; m += 2) {
        const x = left + pw - (pw * m * 60) / this.window;
        g.fillText(m === 0 ? 'now' : '-' + m + 'm', x, H - 6);
      }
      pts.forEach((p, i) => {
        if (!p) return;
        const x = left + i * bw;
        const okRate = (p.done - p.failed) / this.bucket, badRate = p.failed / this.bucket;
        const hOk = (ph * okRate) / maxRate, hBad = (ph * badRate) / maxRate;
        g.fillStyle = ok.trim() || '#2e9e5b';
        g.fillRect(x + 0.5, top + ph - hOk, Math.max(1, bw - 1), hOk);
        g.fillStyle = '#d9534f';
        g.fillRect(x + 0.5, top + ph - hOk - hBad, Math.max(1, bw - 1), hBad);
      });
      // A line through the points of `key`, with a dot on each (a lone
      // point has no line).
      const line = (key, colour) => {
        g.strokeStyle = colour;
        g.fillStyle = colour;
        g.lineWidth = 2;
        g.beginPath();
        let open = false;
        const dots = [];
        pts.forEach((p, i) => {
          if (!p || p[key] === null || p[key] === undefined) { open = false; return; }
          const x = left + i * bw + bw / 2, y = top + ph - (ph * p[key]) / maxLat;
          if (open) g.lineTo(x, y); else g.moveTo(x, y);
          open = true;
          dots.push([x, y]);
        });
        g.stroke();
        for (const [x, y] of dots) {
          g.beginPath();
          g.arc(x, y, 2.5, 0, 2 * Math.PI);
          g.fill();
        }
      };
      line('p50_ms', '#2f6fdf');
      line('p95_ms', '#e08a1e');
      // The bucket before the current one is the newest complete one.
      const recent = pts[n - 2] || pts[n - 1];
      const lastAt = [...this.points.keys()].filter((t) => t <= end).sort((a, b) => b - a)[0];
      let text;
      if (recent) {
        text = 'last ' + this.bucket + ' s: ' + (recent.done / this.bucket).toFixed(1) + ' finished/s' +
          (recent.p50_ms !== null ? ', p50 ' + fmtDuration(recent.p50_ms) + ', p95 ' + fmtDuration(recent.p95_ms) + ' (' + recent.samples + ' timed)' : '');
      } else if (lastAt) {
        text = 'none finished in the last ' + this.bucket + ' s; the last ones at ' + fmtTime(new Date(lastAt * 1000).toISOString());
      } else {
        text = 'no task finished in the last 10 minutes';
      }
      setText($('chart-now'), text);
    },
  };

  // -------------------------------------------------------------- results

  const MAX_RESULT_ROWS = 1000;

  const Results = {
    rows: new Map(), // id -> {el, c, seq}
    body: null,
    filter: { status: '', label: '', prefix: '', since: '' },
    next: null,
    loaded: false,
    loading: false,

    init() {
      this.body = $('results-table').querySelector('.body');
      $('results-filter').addEventListener('submit', (e) => {
        e.preventDefault();
        this.filter = {
          status: $('f-status').value,
          label: $('f-label').value.trim(),
          prefix: $('f-prefix').value.trim(),
          since: $('f-since').value.trim(),
        };
        this.reload();
      });
      $('results-more').addEventListener('click', () => this.load(this.next));
    },

    enter() { if (!this.loaded) this.reload(); },

    reload() {
      this.rows.clear();
      this.body.replaceChildren();
      this.load(null);
    },

    query(before) {
      const p = new URLSearchParams();
      for (const [k, v] of Object.entries(this.filter)) if (v) p.set(k, v);
      p.set('limit', '50');
      if (before) p.set('before', before);
      return '/api/results?' + p.toString();
    },

    async load(before) {
      if (this.loading) return;
      this.loading = true;
      $('results-more').disabled = true;
      try {
        const page = await getJSON(this.query(before));
        this.loaded = true;
        for (const r of page.rows) if (!this.rows.has(r.id)) this.body.append(this.makeRow(r).el);
        this.next = page.next_before;
        $('results-more').hidden = !this.next;
        setText($('results-info'), this.rows.size + ' tasks shown' +
          (page.reached ? ' · read back to ' + fmtTime(page.reached) : '') +
          (this.next ? '' : ' · end of the stream'));
        $('results-empty').hidden = this.rows.size > 0;
      } catch (e) {
        setText($('results-info'), e.message);
      } finally {
        this.loading = false;
        $('results-more').disabled = false;
      }
    },

    makeRow(r) {
      const c = {
        id: h('span', null, taskLink(r.id)),
        label: h('span'),
        status: h('span', null, h('span')),
        attempt: h('span', { class: 'num' }),
        duration: h('span', { class: 'num' }),
        worker: h('span'),
        finished: h('span'),
        snippet: h('span', { class: 'snippet' }),
      };
      const el = h('div', { class: 'row' }, c.id, c.label, c.status, c.attempt, c.duration, c.worker, c.finished, c.snippet);
      const e = { el, c, seq: 0 };
      this.rows.set(r.id, e);
      this.fill(e, r);
      return e;
    },

    fill(e, r) {
      e.seq = r.seq;
      const c = e.c;
      setText(c.label, r.label);
      setBadge(c.status.firstChild, r.status, r.final);
      setText(c.attempt, r.attempt + '/' + r.max_attempts);
      setText(c.duration, r.status === 'running' ? '' : fmtDuration(r.duration_ms));
      setText(c.worker, r.worker);
      setText(c.finished, r.status === 'running' ? 'started ' + fmtTime(r.started_at) : fmtTime(r.finished_at));
      setText(c.snippet, r.snippet);
    },

    matches(r) {
      const f = this.filter;
      return (!f.status || f.status === r.status) &&
        (!f.label || f.label === r.label) &&
        (!f.prefix || r.id.startsWith(f.prefix));
    },

    // Live records: the task's row is updated and moves to the top.
    apply(ev) {
      if (!this.loaded) return;
      for (const r of ev.rows || []) {
        const e = this.rows.get(r.id);
        if (e && r.seq <= e.seq) continue;
        if (!this.matches(r)) {
          if (e) { e.el.remove(); this.rows.delete(r.id); }
          continue;
        }
        if (e) {
          this.fill(e, r);
          if (this.body.firstChild !== e.el) this.body.prepend(e.el);
        } else {
          this.body.prepend(this.makeRow(r).el);
        }
      }
      while (this.rows.size > MAX_RESULT_ROWS) {
        const last = this.body.lastChild;
        if (!last) break;
        for (const [id, e] of this.rows) if (e.el === last) { this.rows.delete(id); break; }
        last.remove();
      }
      $('results-empty').hidden = this.rows.size > 0;
    },
  };

  // ----------------------------------------------------------------- task

  const MAX_LIVE_CHARS = 2 * 1024 * 1024;

  const Task = {
    id: null,
    es: null,
    last: null,
    attempt: null,
    liveChars: 0,

    init() {
      $('task-cancel').addEventListener('click', async (e) => {
        if (!this.id) return;
        await doAction('cancel', { id: this.id }, e.target);
      });
      $('task-replay').addEventListener('click', async (e) => {
        if (!this.id) return;
        const a = await doAction('replay', { id: this.id }, e.target);
        if (a && a.new_id) location.hash = '#/task/' + encodeURIComponent(a.new_id);
      });
    },

    close() {
      if (this.es) { this.es.close(); this.es = null; }
      this.id = null;
    },

    async open(id) {
      this.close();
      this.id = id;
      this.last = null;
      this.attempt = null;
      this.liveChars = 0;
      setText($('task-id'), id || '');
      setText($('task-where'), '');
      $('task-attempts').replaceChildren();
      $('task-live').replaceChildren();
      $('task-dead').replaceChildren();
      $('task-dead').hidden = true;
      $('task-live-box').hidden = true;
      this.status(null);
      if (!id) return;
      await this.refresh();
      if (this.id !== id) return;
      if (!this.last || !this.last.final) this.follow();
    },

    status(last) {
      const b = $('task-status');
      if (!last) {
        setBadge(b, 'unknown', true);
        setText(b, 'no record yet');
      } else {
        setBadge(b, last.status, last.final);
      }
      const finished = !!(last && last.final);
      $('task-cancel').hidden = finished;
      const failedish = finished && last.status !== 'success';
      $('task-replay').hidden = !failedish;
    },

    async refresh() {
      const id = this.id;
      let view;
      try {
        view = await getJSON('/api/tasks/' + encodeURIComponent(id));
      } catch (e) {
        setText($('task-where'), e.message);
        return;
      }
      if (this.id !== id) return;
      const recs = view.records || [];
      this.last = recs.length ? recs[recs.length - 1] : null;
      this.status(this.last);
      if (this.last) {
        setText($('task-where'), 'label ' + this.last.label + ' · attempt ' + this.last.attempt + ' of ' + this.last.max_attempts +
          (this.last.worker_id ? ' · ' + this.last.worker_id : ''));
      } else {
        setText($('task-where'), 'queued or unknown: no record stored yet');
      }
      const box = $('task-attempts');
      box.replaceChildren();
      for (const r of recs.slice().reverse()) box.append(this.attemptBlock(r));
      const dead = $('task-dead');
      dead.replaceChildren();
      if (view.dead) {
        dead.append(h('strong', { text: 'Dead letter: ' }), view.dead.reason + ' (' + fmtTime(view.dead.time) + ')');
        dead.hidden = false;
        setText($('task-replay'), 'Replay');
      } else {
        dead.hidden = true;
        setText($('task-replay'), 'Retry');
      }
    },

    attemptBlock(r) {
      const state = r.status === 'running' || r.status === 'queued';
      const rows = [
        ['status', null],
        ['worker', r.worker_id],
        ['started', fmtTime(r.started_at)],
      ];
      if (!state) rows.push(['finished', fmtTime(r.finished_at) + ' (' + fmtDuration(r.duration_ms) + ')']);
      if (r.exit_code !== null && r.exit_code !== undefined) rows.push(['exit code', r.exit_code]);
      if (r.signal) rows.push(['signal', r.signal]);
      if (r.http_status) rows.push(['http', r.http_status]);
      if (r.retry_in_ms) rows.push(['retry in', fmtDuration(r.retry_in_ms)]);
      if (r.error) rows.push(['error', r.error]);
      if (!state) {
        rows.push(['output', r.output_bytes + ' bytes' + (r.output_truncated ? ' (truncated: head and tail kept)' : '')]);
      }
      const dl = h('dl', { class: 'kv' });
      for (const [k, v] of rows) {
        dl.append(h('dt', { text: k }));
        if (k === 'status') dl.append(h('dd', null, badge(r.status, r.final)));
        else dl.append(h('dd', { text: String(v), class: k === 'error' ? 'error' : null }));
      }
      const block = h('div', { class: 'attempt' },
        h('div', { class: 'attempt-head', text: (state ? r.status + ' · attempt ' : 'attempt ') + r.attempt + ' of ' + r.max_attempts }),
        dl);
      if (!state) block.append(h('pre', { class: 'output', text: r.output }));
      return block;
    },

    follow() {
      const id = this.id;
      $('task-live-box').hidden = false;
      setText($('task-live-state'), '· following');
      const es = new EventSource('/api/tasks/' + encodeURIComponent(id) + '/live');
      this.es = es;
      const pre = $('task-live');
      const append = (text, cls) => {
        this.liveChars += text.length;
        if (cls) pre.append(h('span', { class: cls, text }));
        else pre.append(document.createTextNode(text));
        while (this.liveChars > MAX_LIVE_CHARS && pre.firstChild) {
          this.liveChars -= pre.firstChild.textContent.length;
          pre.firstChild.remove();
        }
        pre.scrollTop = pre.scrollHeight;
      };
      es.addEventListener('chunk', (e) => {
        const d = JSON.parse(e.data);
        if (d.attempt && this.attempt !== null && d.attempt !== this.attempt) {
          append('\n── attempt ' + d.attempt + ' ──\n', 'marker');
        }
        if (d.attempt) this.attempt = d.attempt;
        append(d.data, d.stream === 'stderr' ? 'stderr' : null);
      });
      es.addEventListener('skipped', (e) => {
        const d = JSON.parse(e.data);
        append('\n[' + d.bytes + ' bytes of live output skipped (rate cap); the result keeps them]\n', 'marker');
      });
      es.addEventListener('eof', (e) => {
        const d = JSON.parse(e.data);
        if (!d.final) append('\n── attempt ended; a retry follows ──\n', 'marker');
        this.refresh();
      });
      es.addEventListener('final', () => {
        es.close();
        if (this.es === es) this.es = null;
        setText($('task-live-state'), '· finished: the stored output is below');
        // The stored output replaces the live one.
        $('task-live-box').hidden = true;
        this.refresh();
      });
      es.addEventListener('error', (e) => {
        if (e.data) setText($('task-live-state'), '· ' + JSON.parse(e.data).message);
      });
    },

    // A record of this task arrived on the results feed: show it (and
    // follow the output of an attempt that started since).
    apply(ev) {
      if (current !== 'task' || !this.id) return;
      if (!(ev.rows || []).some((r) => r.id === this.id)) return;
      const id = this.id;
      this.refresh().then(() => {
        if (this.id === id && this.last && !this.last.final && !this.es) this.follow();
      });
    },
  };

  // ----------------------------------------------------------------- dead

  const Dead = {
    async load() {
      const label = $('dead-label').value.trim();
      const tbody = $('dead-table').tBodies[0];
      try {
        const list = await getJSON('/api/dead?limit=200' + (label ? '&label=' + encodeURIComponent(label) : ''));
        tbody.replaceChildren();
        for (const d of list) {
          const action = h('td', { class: 'action-only' });
          const b = h('button', { type: 'button', text: 'Replay' });
          b.addEventListener('click', async () => {
            const a = await doAction('replay', { id: d.id }, b);
            if (a && a.new_id) location.hash = '#/task/' + encodeURIComponent(a.new_id);
          });
          action.append(b);
          tbody.append(h('tr', null,
            h('td', { text: fmtTime(d.time) }),
            h('td', null, taskLink(d.id)),
            h('td', { text: d.label }),
            // The final status that put it there, where the letter says.
            h('td', null, d.status ? badge(d.status, true) : '–'),
            h('td', { text: d.reason, class: 'error' }),
            h('td', null, h('code', { class: 'task-json', text: d.task })),
            action));
        }
        setText($('dead-info'), list.length + ' shown, newest first');
        $('dead-empty').hidden = list.length > 0;
      } catch (e) {
        setText($('dead-info'), e.message);
      }
    },
  };

  // ------------------------------------------------------------ schedules

  const Schedules = {
    list: [],
    timer: null,

    async load() {
      const tbody = $('schedules-table').tBodies[0];
      try {
        this.list = await getJSON('/api/schedules');
        tbody.replaceChildren();
        for (const s of this.list) {
          s.nextCell = h('td');
          tbody.append(h('tr', null,
            h('td', { class: 'id', text: s.name }),
            h('td', null, h('code', { text: s.spec })),
            h('td', { text: s.time_zone || 'UTC' }),
            s.nextCell,
            h('td', { text: s.target }),
            h('td', null, h('code', { class: 'task-json', text: s.task }))));
        }
        this.tick();
        setText($('schedules-info'), this.list.length + ' schedules');
        $('schedules-empty').hidden = this.list.length > 0;
        clearInterval(this.timer);
        // Counting down a handful of cells, only while the view is open.
        this.timer = setInterval(() => {
          if (current !== 'schedules') { clearInterval(this.timer); return; }
          this.tick();
        }, 1000);
      } catch (e) {
        setText($('schedules-info'), e.message);
      }
    },

    tick() {
      const now = Date.now();
      for (const s of this.list) {
        if (!s.next) { setText(s.nextCell, '–'); continue; }
        const ms = new Date(s.next).getTime() - now;
        setText(s.nextCell, fmtTime(s.next) + (ms >= 0 ? ' (in ' + fmtDuration(Math.round(ms / 1000) * 1000) + ')' : ' (due)'));
      }
    },
  };

  // --------------------------------------------------------------- submit

  // The JSON Schema keywords the task schema uses (schemars, draft 2020-12).
  const Schema = {
    root: null,

    resolve(ref) {
      const parts = ref.replace(/^#\//, '').split('/');
      let s = this.root;
      for (const p of parts) s = s && s[p];
      return s || {};
    },

    typeOf(v) {
      if (v === null) return 'null';
      if (Array.isArray(v)) return 'array';
      if (typeof v === 'number') return Number.isInteger(v) ? 'integer' : 'number';
      return typeof v;
    },

    isType(v, t) {
      const a = this.typeOf(v);
      return a === t || (t === 'number' && a === 'integer');
    },

    check(s, v, path, errs) {
      if (!s || typeof s !== 'object') return;
      if (s.$ref) return this.check(this.resolve(s.$ref), v, path, errs);
      if (s.anyOf) {
        let best = null;
        for (const alt of s.anyOf) {
          const e = [];
          this.check(alt, v, path, e);
          if (!e.length) { best = null; break; }
          if (!best || e.length < best.length) best = e;
        }
        if (best) errs.push(...best);
        return;
      }
      if (s.type) {
        const types = Array.isArray(s.type) ? s.type : [s.type];
        if (!types.some((t) => this.isType(v, t))) {
          errs.push(path + ': expected ' + types.join(' or ') + ', found ' + this.typeOf(v));
          return;
        }
      }
      if (s.enum && !s.enum.includes(v)) errs.push(path + ': one of ' + s.enum.join(', '));
      if (typeof v === 'number') {
        if (s.minimum !== undefined && v < s.minimum) errs.push(path + ': at least ' + s.minimum);
        if (s.maximum !== undefined && v > s.maximum) errs.push(path + ': at most ' + s.maximum);
      }
      if (Array.isArray(v)) {
        if (s.minItems !== undefined && v.length < s.minItems) errs.push(path + ': at least ' + s.minItems + ' items');
        if (s.maxItems !== undefined && v.length > s.maxItems) errs.push(path + ': at most ' + s.maxItems + ' items');
        if (s.items) v.forEach((x, i) => this.check(s.items, x, path + '[' + i + ']', errs));
      }
      if (this.typeOf(v) === 'object') {
        for (const r of s.required || []) if (!(r in v)) errs.push(path + '.' + r + ': required');
        const props = s.properties || {};
        for (const [k, x] of Object.entries(v)) {
          if (k in props) this.check(props[k], x, path + '.' + k, errs);
          else if (s.additionalProperties === false) errs.push(path + '.' + k + ': unknown field');
          else if (s.additionalProperties && typeof s.additionalProperties === 'object') this.check(s.additionalProperties, x, path + '.' + k, errs);
        }
      }
    },

    validate(v) {
      const errs = [];
      this.check(this.root, v, '$', errs);
      return errs;
    },
  };

  const TEMPLATES = {
    shell: { type: 'shell', script: 'echo hello from the dashboard' },
    command: { type: 'command', command: '/bin/echo', args: ['hello'] },
    http: { type: 'http', url: 'https://example.com/', method: 'GET' },
    container: { type: 'container', image: 'busybox', args: ['echo', 'hello'] },
  };

  const Submit = {
    ready: false,

    async enter() {
      if (!this.ready) {
        this.ready = true;
        $('s-task').value = JSON.stringify(TEMPLATES.shell, null, 2);
        try {
          Schema.root = await getJSON('/api/schema');
        } catch (e) {
          toast('cannot load the task schema: ' + e.message, true);
        }
      }
      this.check();
    },

    init() {
      $('s-template').addEventListener('change', (e) => {
        $('s-task').value = JSON.stringify(TEMPLATES[e.target.value], null, 2);
        this.check();
      });
      $('s-task').addEventListener('input', () => this.check());
      $('s-label').addEventListener('input', () => this.check());
      $('submit-form').addEventListener('submit', (e) => { e.preventDefault(); this.send(); });
    },

    // The errors of the form as it stands (empty: it may be sent).
    errors() {
      const errs = [];
      const label = $('s-label').value.trim();
      if (!/^[A-Za-z0-9_-]{1,64}$/.test(label)) errs.push('label: [A-Za-z0-9_-]{1,64}');
      let task;
      try {
        task = JSON.parse($('s-task').value);
      } catch (e) {
        errs.push('not JSON: ' + e.message);
        return { errs, task: null, label };
      }
      if (Schema.root) errs.push(...Schema.validate(task));
      if (task && typeof task === 'object' && !Array.isArray(task) && !task.type) errs.push('$.type: required');
      return { errs, task, label };
    },

    check() {
      const { errs } = this.errors();
      const ul = $('s-errors');
      ul.replaceChildren(...errs.map((e) => h('li', { text: e })));
      $('s-submit').disabled = errs.length > 0;
      return errs.length === 0;
    },

    async send() {
      const { errs, task, label } = this.errors();
      if (errs.length) return this.check();
      const a = await doAction('submit', { label, task }, $('s-submit'));
      if (a && a.id) {
        $('s-result').replaceChildren('submitted ', taskLink(a.id));
        location.hash = '#/task/' + encodeURIComponent(a.id);
      }
    },
  };

  // ----------------------------------------------------------------- feed

  function connect() {
    const es = new EventSource('/api/events');
    const conn = $('conn');
    es.addEventListener('open', () => {
      if (!document.body.dataset.ready) performance.mark('jetworker-feed-open');
      conn.textContent = 'live';
      conn.className = 'conn up';
    });
    es.addEventListener('error', () => { conn.textContent = 'reconnecting…'; conn.className = 'conn down'; });
    es.addEventListener('snapshot', (e) => {
      const s = JSON.parse(e.data);
      Workers.snapshot(s.workers);
      Queues.snapshot(s.queues);
      Chart.snapshot(s.stats, s.bucket_secs, s.window_secs);
      conn.textContent = 'live';
      conn.className = 'conn up';
      if (!document.body.dataset.ready) performance.mark('jetworker-snapshot');
      document.body.dataset.ready = '1';
    });
    es.addEventListener('workers', (e) => Workers.apply(JSON.parse(e.data)));
    es.addEventListener('queues', (e) => Queues.apply(JSON.parse(e.data)));
    es.addEventListener('stats', (e) => Chart.apply(JSON.parse(e.data)));
    es.addEventListener('results', (e) => {
      const ev = JSON.parse(e.data);
      Results.apply(ev);
      Task.apply(ev);
    });
  }

  function start() {
    document.body.classList.toggle('no-actions', !ACTIONS);
    setText($('mode'), ACTIONS ? ' · actions on' : ' · read-only');
    Workers.init();
    Queues.init();
    Results.init();
    Task.init();
    Submit.init();
    $('dead-refresh').addEventListener('click', () => Dead.load());
    $('dead-label').addEventListener('change', () => Dead.load());
    $('schedules-refresh').addEventListener('click', () => Schedules.load());
    window.addEventListener('hashchange', route);
    window.addEventListener('resize', () => { if (current === 'queues') Chart.draw(); });
    route();
    connect();
  }

  // For the browser tests and the benchmark: what the page holds.
  window.jetworkerUi = { Workers, Queues, Results, Task, Chart };

  start();
})();
