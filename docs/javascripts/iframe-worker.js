// The site's search from disk (file://), with no script from another host.
//
// The theme's search runs in a Web Worker, and a browser does not start one from a file:// page. Where
// the page is a file, this script stands in for `Worker` (the theme's offline plugin would load its own
// stand-in from unpkg.com; this file's name tells the plugin that one is here): the worker's script runs
// in a hidden iframe of the page, which a file may load, and messages pass between the two as they would
// between a page and its worker. Served over http(s), the browser's own Worker is left as it is.
(function () {
  "use strict";
  if (location.protocol !== "file:") {
    return;
  }

  class IFrameWorker extends EventTarget {
    constructor(url) {
      super();
      this.onmessage = null;
      this.onerror = null;
      this.pending = [];  // messages posted before the worker's script has loaded
      this.frame = document.createElement("iframe");
      this.frame.hidden = true;
      this.frame.setAttribute("aria-hidden", "true");
      (document.body || document.documentElement).appendChild(this.frame);
      const scope = this.frame.contentWindow;
      // What the worker's script calls on its global scope: postMessage back to the page, and
      // importScripts (asynchronous here: the theme's search worker awaits it).
      scope.postMessage = (data) => this.receive(data);
      scope.importScripts = (...urls) => urls.reduce(
        (done, src) => done.then(() => load(scope.document, new URL(src, url).href)), Promise.resolve());
      load(scope.document, new URL(url, location.href).href).then(
        () => {
          this.frame.dataset.loaded = "true";
          this.pending.splice(0).forEach((data) => this.deliver(data));
        },
        (error) => this.fail(error));
    }

    postMessage(data) {
      if (this.frame.dataset.loaded) {
        this.deliver(data);
      } else {
        this.pending.push(data);
      }
    }

    terminate() {
      this.frame.remove();
    }

    deliver(data) {  // page -> worker
      const scope = this.frame.contentWindow;
      scope.dispatchEvent(new scope.MessageEvent("message", { data: data }));
    }

    receive(data) {  // worker -> page
      const event = new MessageEvent("message", { data: data });
      if (typeof this.onmessage === "function") {
        this.onmessage(event);
      }
      this.dispatchEvent(event);
    }

    fail(error) {
      const event = new ErrorEvent("error", { message: String(error) });
      if (typeof this.onerror === "function") {
        this.onerror(event);
      }
      this.dispatchEvent(event);
    }
  }

  function load(doc, src) {
    return new Promise((resolve, reject) => {
      const script = doc.createElement("script");
      script.src = src;
      script.onload = resolve;
      script.onerror = () => reject(new Error("could not load " + src));
      (doc.body || doc.documentElement).appendChild(script);
    });
  }

  window.IFrameWorker = IFrameWorker;  // the theme's search worker looks for it to find its own folder
  window.Worker = IFrameWorker;
})();
